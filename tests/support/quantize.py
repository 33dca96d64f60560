"""Quantized checkpoint folders made at test time with this pin's own ``mx.quantize``."""

from __future__ import annotations

import json
import pathlib
import shutil

import mlx.core as mx


def quantize_folder(source: pathlib.Path, out: pathlib.Path, mode: str, group: int, bits: int) -> pathlib.Path:
    """Copy of the MLX-layout folder ``source`` at ``out``, its text weights quantized as mlx-vlm's
    converter picks them (2-D, input size divisible by ``group``); the vision tower stays float."""
    shutil.copytree(source, out)
    weights = mx.load(str(source / "model.safetensors"))
    stored = {}
    for key, w in weights.items():
        if key.startswith("language_model.") and key.endswith(".weight") and w.ndim == 2 and w.shape[-1] % group == 0:
            q = mx.quantize(w, group_size=group, bits=bits, mode=mode)
            prefix = key[: -len(".weight")]
            stored[key], stored[prefix + ".scales"] = q[0], q[1]
            if mode == "affine":
                stored[prefix + ".biases"] = q[2]
        else:
            stored[key] = w
    config = json.loads((source / "config.json").read_text())
    config["quantization"] = {"group_size": group, "bits": bits, "mode": mode}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), stored, metadata={"format": "mlx"})
    return out
