"""Items 8 and 9: checkpoints as published (quantized; both weight layouts) load and compute right."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, Tuple

import numpy as np

from ..harness import LOGIT_TOL, N_GREEDY, Context, max_abs
from ..report import FAIL, PASS, Item, ItemResult, error_text, fmt
from .base import needs_package, result

QUANT_GROUP, QUANT_BITS = 64, 4
# Quantized model vs a float model holding its dequantized weights: only summation order differs.
QUANT_TWIN_TOL = 1e-3


def _quantize_checkpoint(ctx: Context) -> Tuple[Path, Path, int]:
    """Quantize the tiny MLX-layout checkpoint in-process (4-bit, group 64, affine) and save it.

    The float model is loaded through the implementation under test (``mlx_vlm.utils.load_model``,
    as ``mlx_vlm convert`` would) and quantized with ``mlx.nn.quantize``; layers whose input
    dimension is not a multiple of 64 (the tiny vision tower's 32-wide blocks and position
    table) stay float, which is what the predicate says. Also saves its float "twin": the same
    checkpoint with every quantized weight dequantized, i.e. exactly what the quantized model
    must compute. Returns (quantized folder, twin folder, number of quantized modules written).
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_model

    source = ctx.checkpoint("mlx")
    model = load_model(source)
    ctx.check_model_source(model)

    def fits(path: str, module: nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        return hasattr(module, "to_quantized") and weight is not None and weight.shape[-1] % QUANT_GROUP == 0

    nn.quantize(model, group_size=QUANT_GROUP, bits=QUANT_BITS, class_predicate=fits)
    weights = dict(tree_flatten(model.parameters()))
    prefixes = [key[: -len(".scales")] for key in weights if key.endswith(".scales")]
    twin = dict(weights)
    for prefix in prefixes:
        twin[prefix + ".weight"] = mx.dequantize(
            twin[prefix + ".weight"],
            twin.pop(prefix + ".scales"),
            twin.pop(prefix + ".biases"),
            group_size=QUANT_GROUP,
            bits=QUANT_BITS,
        )
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    folders = (ctx.workdir / "quantized", ctx.workdir / "dequantized_twin")
    for folder, tensors, quantization in ((folders[0], weights, True), (folders[1], twin, False)):
        folder.mkdir(parents=True, exist_ok=True)
        for path in source.iterdir():
            if path.name not in ("model.safetensors", "config.json"):
                shutil.copyfile(path, folder / path.name)
        mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "mlx"})
        conf = dict(config)
        if quantization:
            conf["quantization"] = {"group_size": QUANT_GROUP, "bits": QUANT_BITS, "mode": "affine"}
        (folder / "config.json").write_text(json.dumps(conf, indent=2) + "\n", encoding="utf-8")
    return folders[0], folders[1], len(prefixes)


@needs_package
def check_quantized(ctx: Context, item: Item) -> ItemResult:
    """Item 8: quantize, reload with mlx_vlm.load, compare with the dequantized twin, generate."""
    import mlx.nn as nn

    folder, twin_folder, written = _quantize_checkpoint(ctx)
    model, processor = ctx.load(folder)
    twin, _ = ctx.load(twin_folder)
    quantized = sum(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    details: Dict[str, Any] = {"quantized_modules_written": written, "quantized_modules_loaded": quantized, "cases": {}}
    problems = []
    if quantized != written or written == 0:
        problems.append(f"{quantized} quantized modules loaded, {written} written")
    parts = []
    for name in (ctx.reference.names("text")[0], ctx.reference.names("image")[0]):
        case = ctx.reference(name)
        ids, pixels, extra = ctx.model_inputs(name)
        row: Dict[str, Any] = {}
        try:
            logits = ctx.prefill_logits(model, ids, pixels, extra)
            row["twin_max_abs"] = max_abs(logits, ctx.prefill_logits(twin, ids, pixels, extra))
            row["reference_top1_agreement"] = float(np.mean(logits.argmax(-1) == case["prefill_logits"].argmax(-1)))
            run = ctx.prompt_path(
                model, processor, ctx.reference.cases[name]["prompt"], ctx.reference.image_paths(name), N_GREEDY
            )
            row["generated"] = len(run["tokens"])
            if not (len(run["tokens"]) == N_GREEDY or (run["tokens"] and run["tokens"][-1] == ctx.eos_id())):
                problems.append(f"{name}: stream_generate gave {len(run['tokens'])} tokens")
            if not row["twin_max_abs"] <= QUANT_TWIN_TOL:
                problems.append(
                    f"{name}: quantized logits differ from the dequantized twin's by "
                    f"{fmt(row['twin_max_abs'])} (tol {fmt(QUANT_TWIN_TOL)})"
                )
            parts.append(
                f"{name}: max|quantized - dequantized twin| {fmt(row['twin_max_abs'])}, "
                f"{row['generated']} tokens generated (top-1 = float reference at "
                f"{row['reference_top1_agreement']:.0%} of positions)"
            )
        except Exception as exc:  # the error is the evidence
            row["error"] = error_text(exc)
            problems.append(f"{name}: {row['error']}")
        details["cases"][name] = row
    head = (
        f"4-bit group-64 affine, quantized with mlx.nn.quantize: {quantized}/{written} quantized "
        f"modules reloaded; " + "; ".join(parts)
    )
    if problems:
        return result(ctx, item, FAIL, head + "\nproblems: " + "; ".join(problems), details)
    return result(ctx, item, PASS, head + f" (tol {fmt(QUANT_TWIN_TOL)})", details)


@needs_package
def check_layouts(ctx: Context, item: Item) -> ItemResult:
    """Item 9: both weight layouts load (strictly) and give the reference logits."""
    details: Dict[str, Any] = {}
    parts, problems = [], []
    cases = (ctx.reference.names("text")[0], ctx.reference.names("image")[0])
    for layout in ("original", "mlx"):
        try:
            model, _ = ctx.load(ctx.checkpoint(layout))
            diffs = {}
            for name in cases:
                ids, pixels, extra = ctx.model_inputs(name)
                diffs[name] = max_abs(
                    ctx.prefill_logits(model, ids, pixels, extra), ctx.reference(name)["prefill_logits"]
                )
            details[layout] = diffs
            worst = max(diffs.values())
            parts.append(f"{layout}: max|dlogits| {fmt(worst)} on {', '.join(cases)}")
            if not worst <= LOGIT_TOL:
                problems.append(f"{layout} logits off by {fmt(worst)}")
        except Exception as exc:  # the error is the evidence
            details[layout] = {"error": error_text(exc)}
            problems.append(f"{layout}: {error_text(exc)}")
    evidence = "; ".join(parts)
    if problems:
        return result(
            ctx, item, FAIL, (evidence + "\n" if evidence else "") + "problems: " + "; ".join(problems), details
        )
    return result(ctx, item, PASS, evidence + f" (tol {fmt(LOGIT_TOL)})", details)
