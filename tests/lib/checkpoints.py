"""Edited copies of a checkpoint folder: copied, a JSON file or the weights edited, quantized, dequantized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors.numpy import load_file, save_file


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of the folder ``src`` at ``dst``."""
    shutil.copytree(src, dst)
    return dst


def edit_json(folder: Path, name: str, edit: Callable[[dict], None]) -> None:
    """Rewrite ``folder/name`` after ``edit`` changed its parsed JSON in place."""
    data = json.loads((folder / name).read_text(encoding="utf-8"))
    edit(data)
    (folder / name).write_text(json.dumps(data), encoding="utf-8")


def edit_weights(folder: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite ``folder/model.safetensors`` after ``edit`` changed its tensors (a dict) in place."""
    weights = load_file(str(folder / "model.safetensors"))
    edit(weights)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def quantize_checkpoint(src: Path, dst: Path, bits: int = 4, group_size: int = 32) -> Path:
    """An MLX-quantized copy (as mlx-vlm's convert writes one) of the tiny checkpoint."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_model

    copy_checkpoint(src, dst)
    model = load_model(dst)

    def predicate(path, module):
        weight = getattr(module, "weight", None)
        return hasattr(module, "to_quantized") and weight.shape[-1] % group_size == 0 and weight.size % 64 == 0

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "mlx"})
    edit_json(dst, "config.json", lambda c: c.__setitem__("quantization", {"group_size": group_size, "bits": bits}))
    return dst


def read_weights(folder: Path) -> dict:
    """Every tensor of the folder's safetensors files, as MLX arrays."""
    import mlx.core as mx

    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def quantization_params(quantization: dict, path: str) -> dict:
    """The quantization settings of the layer at ``path``: its own entry, else the top-level ones."""
    entry = quantization.get(path)
    return entry if isinstance(entry, dict) else quantization


def quantization_mode(weights: dict, quantization: dict, path: str) -> str:
    """The mode the layer at ``path`` was stored in."""
    # Affine is the one mode that stores biases; a per-layer entry may omit the mode.
    return "affine" if f"{path}.biases" in weights else quantization_params(quantization, path).get("mode", "affine")


def dequantized_checkpoint(quantized: Path, out: Path, float32: bool = False) -> Path:
    """The same checkpoint unquantized at ``out``: mx.dequantize of each stored weight (its layer's
    settings and mode), in its own dtype or, with ``float32``, all in float32."""
    import mlx.core as mx

    shutil.copytree(quantized, out)
    config = json.loads((quantized / "config.json").read_text())
    quantization = config.pop("quantization")
    config.pop("quantization_config", None)
    if float32:
        config["dtype"] = "float32"
    weights = read_weights(quantized)
    dense = {}
    for key, value in weights.items():
        if key.endswith((".scales", ".biases")):
            continue
        path = key[: -len(".weight")]
        if key.endswith(".weight") and f"{path}.scales" in weights:
            params = quantization_params(quantization, path)
            value = mx.dequantize(
                value,
                weights[f"{path}.scales"],
                weights.get(f"{path}.biases"),
                group_size=params["group_size"],
                bits=params["bits"],
                mode=quantization_mode(weights, quantization, path),
            )
        dense[key] = value.astype(mx.float32) if float32 else value
    for f in list(out.glob("*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        f.unlink()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), dense, metadata={"format": "mlx"})
    return out
