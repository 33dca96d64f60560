"""mlx-vlm's conversion recipes through the pin's own converter, and what a converted folder is
checked against: the recipe's rule for each layer's bits, and the same model holding
``mx.dequantize`` of its stored weights, for tests/test_conversion_recipes.py.
"""

from __future__ import annotations

import builtins
import json
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

TOL = 1e-4  # quantized vs its own dequantized weights: the same products, another order at most
# The fp modes' embedding lookup returns bfloat16, so both models carry bfloat16 activations and
# agree to bfloat16 rounding: a sum in another order can round one ulp the other way (measured:
# 0.0625 = 2**-8 * 16 on mxfp8, 0.7.10). Two ulps of the largest logit.
BF16_ULPS = 2 * 2.0**-8
MIXED = {  # recipe: (low bits, high bits), mlx-vlm's table
    "mixed_2_6": (2, 6),
    "mixed_3_4": (3, 4),
    "mixed_3_5": (3, 5),
    "mixed_3_6": (3, 6),
    "mixed_3_8": (3, 8),
    "mixed_4_6": (4, 6),
    "mixed_4_8": (4, 8),
}
FP_MODES = {"mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}  # mode: (group, bits)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
RTN = sorted(MIXED) + sorted(FP_MODES)
ALL = RTN + ["awq_q4", "awq_multimodal"]


def _parser_choices(flag: str) -> tuple:
    from mlx_vlm.convert import configure_parser

    for action in configure_parser()._actions:
        if flag in action.option_strings:
            return tuple(action.choices or ())
    return ()


def offered(recipe: str) -> bool:
    """Whether this pin's converter has the recipe (its own parser says)."""
    if recipe in MIXED:
        return recipe in _parser_choices("--quant-predicate")
    if recipe in FP_MODES:
        return recipe in _parser_choices("--q-mode")
    if recipe.startswith("awq"):
        return "awq" in _parser_choices("--quant-method") and (
            recipe != "awq_multimodal" or "multimodal" in _parser_choices("--calibration")
        )
    return recipe.startswith("rtn")


def recipe_flags(recipe: str) -> list:
    if recipe in MIXED:
        return ["-q", "--quant-predicate", recipe]
    if recipe in FP_MODES:
        return ["-q", "--q-mode", recipe]
    return {
        "rtn_q4": ["-q"],
        "rtn_q8": ["-q", "--q-bits", "8"],
        "awq_q4": ["-q", "--quant-method", "awq"],
        "awq_q8": ["-q", "--quant-method", "awq", "--q-bits", "8"],
        "awq_q8_shared_norm": ["-q", "--quant-method", "awq", "--q-bits", "8"],  # see the test's last test
        "awq_multimodal": ["-q", "--quant-method", "awq", "--calibration", "multimodal"],
    }[recipe]


def convert_with_pin(source: Path, out: Path, recipe: str) -> str:
    """Convert ``source`` into ``out`` with the pin's own parser and ``convert``; returns what it
    printed."""
    from mlx_vlm.convert import configure_parser, convert

    args = configure_parser().parse_args(["--hf-path", str(source), "--mlx-path", str(out), *recipe_flags(recipe)])
    real_print = builtins.print
    printed: List[str] = []
    builtins.print = lambda *a, **k: printed.append(" ".join(map(str, a)))
    try:
        convert(**vars(args))
    finally:
        builtins.print = real_print
    return "\n".join(printed)


def expected_bits(recipe: str, layers: int, high_layers: Sequence[int], heads: Sequence[str]) -> dict:
    """Module path -> (group, bits, mode) the recipe gives each quantized module, by its rule:
    ``high_layers`` are the layers whose v_proj and down_proj take the mixed recipe's high bits,
    as the embedding and ``heads`` (an untied head) do."""
    names = [f"language_model.model.layers.{i}" for i in range(layers)]
    paths = [f"{layer}.{'mlp' if p in MLP else 'self_attn'}.{p}" for layer in names for p in PROJECTIONS]
    paths += ["language_model.model.embed_tokens", *heads]
    if recipe in FP_MODES:
        group, bits = FP_MODES[recipe]
        return {path: (group, bits, recipe) for path in paths}
    low, high = MIXED[recipe]
    out = {}
    for path in paths:
        index = int(m.group(1)) if (m := re.search(r"\.layers\.(\d+)\.", path)) else None
        more = index is None or (index in high_layers and path.endswith(("v_proj", "down_proj")))
        out[path] = (64, high if more else low, "affine")
    return out


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


def assert_stored_as_the_rule(folder: Path, dense: Dict[str, Any], want: dict) -> None:
    """The folder quantized exactly the modules ``want`` names, each the pin's ``mx.quantize`` of
    its float weight in ``dense`` with the rule's group, bits and mode, bit for bit; no vision layer."""
    import mlx.core as mx

    quantization = json.loads((folder / "config.json").read_text())["quantization"]
    weights = read_weights(folder)
    stored = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    assert stored == set(want), f"quantized {sorted(stored ^ set(want))[:6]} against the recipe"
    for path, (group, bits, mode) in want.items():
        params = quantization_params(quantization, path)
        got_mode = quantization_mode(weights, quantization, path)
        assert (params["group_size"], params["bits"], got_mode) == (group, bits, mode), path
        q = mx.quantize(dense[f"{path}.weight"], group_size=group, bits=bits, mode=mode)
        assert mx.array_equal(weights[f"{path}.weight"], q[0]).item(), path
        assert mx.array_equal(weights[f"{path}.scales"], q[1]).item(), path
    assert not any(k.startswith("vision_tower.") and k.endswith(".scales") for k in weights)


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


def tolerance(recipe: str, want: np.ndarray) -> float:
    """How far a converted model's logits may be from its dequantized weights' for ``recipe``."""
    return BF16_ULPS * float(np.abs(want).max()) if recipe in FP_MODES else TOL


def max_drift(logits: List[np.ndarray], base: List[np.ndarray]) -> float:
    """The largest difference between two lists of logits, case by case."""
    return max(float(np.abs(a - b).max()) for a, b in zip(logits, base))


def awq_applied(printed: str) -> Optional[dict]:
    """The converter's "AWQ scaling applied: {...}" summary (layers, groups), None when it printed none."""
    summary = re.search(r"AWQ scaling applied: (\{.*\})", printed)
    return json.loads(summary.group(1).replace("'", '"')) if summary else None
