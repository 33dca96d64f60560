"""Item 4: ``encode_image`` and the cached replay of its output (deepstack included)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from ..harness import Context, max_abs
from ..report import FAIL, PASS, Item, ItemResult, error_text, fmt
from .base import needs_package, result


def _deepstack_of(encoded: Any) -> Optional[Any]:
    if isinstance(encoded, dict):
        for key, value in encoded.items():
            if "deepstack" in str(key):
                return value
    return None


@needs_package
def check_cached_replay(ctx: Context, item: Item) -> ItemResult:
    """Item 4: ``encode_image`` exists and replaying its output gives the uncached logits."""
    model, _ = ctx.load(ctx.checkpoint("original"))
    names = ctx.reference.names("image")
    encode = getattr(model, "encode_image", None)
    if not callable(encode):
        evidence = f"{type(model).__module__}.Model has no public encode_image"
        probe = _replay_probe_without_encode_image(ctx, model, names[0])
        return result(ctx, item, FAIL, evidence + "\n" + probe, {"probe": probe})
    rows = []
    for name in names:
        ids, pixels, extra = ctx.model_inputs(name)
        row: Dict[str, Any] = {"case": name}
        try:
            encoded = encode(pixels, extra["image_grid_thw"])
            uncached = ctx.prefill_logits(model, ids, pixels, extra)
            replay = ctx.prefill_logits(model, ids, None, dict(extra, cached_image_features=encoded))
            row["max_abs"] = max_abs(uncached, replay) if uncached.shape == replay.shape else float("inf")
            deepstack = _deepstack_of(encoded)
            row["deepstack_shape"] = None if deepstack is None else list(np.array(deepstack).shape)
            if hasattr(encoded, "shape") and not isinstance(encoded, dict):
                row["features_shape"] = list(encoded.shape)
        except Exception as exc:  # the error is the evidence
            row["error"] = error_text(exc)
        rows.append(row)
    errors = [f"{r['case']}: {r['error']}" for r in rows if "error" in r]
    diffs = [r["max_abs"] for r in rows if "max_abs" in r]
    ok = not errors and all(d == 0.0 for d in diffs)
    parts = [f"encode_image + get_input_embeddings(cached_image_features=...) on {len(rows)} image cases"]
    if diffs:
        parts.append(f"max|replay - uncached logits| {fmt(max(diffs))} (must be exactly 0)")
    shapes = {
        "none"
        if r["deepstack_shape"] is None
        else "[" + ", ".join([str(r["deepstack_shape"][0]), "N"] + [str(d) for d in r["deepstack_shape"][2:]]) + "]"
        for r in rows
        if "deepstack_shape" in r
    }
    arrays = {f"[N, {r['features_shape'][-1]}]" for r in rows if "features_shape" in r}
    if arrays:
        parts.append(f"encode_image returns one array {', '.join(sorted(arrays))} (deepstack in its columns)")
    else:
        parts.append(f"deepstack in encode_image's output: {', '.join(sorted(shapes)) or 'none'}")
    if errors:
        parts.append("errors: " + "; ".join(errors))
    return result(ctx, item, PASS if ok else FAIL, "; ".join(parts), {"cases": rows})


def _replay_probe_without_encode_image(ctx: Context, model: Any, name: str) -> str:
    """Without encode_image, replay the vision tower's output through ``cached_image_features``
    the way a host would have to, and say how far the logits move (informational)."""
    ids, pixels, extra = ctx.model_inputs(name)
    try:
        tower = model.vision_tower(
            pixels.astype(model.vision_tower.patch_embed.proj.weight.dtype), extra["image_grid_thw"]
        )
        features = tower[0] if isinstance(tower, (tuple, list)) else tower
        uncached = ctx.prefill_logits(model, ids, pixels, extra)
        replay = ctx.prefill_logits(model, ids, pixels, dict(extra, cached_image_features=features))
        moved = max_abs(uncached, replay)
        return (
            f"probe ({name}): replaying the vision tower's features via get_input_embeddings("
            f"cached_image_features=...) moves the logits by max {fmt(moved)}"
            + (" (not a faithful replay)" if moved > 0 else "")
        )
    except Exception as exc:  # informational probe: its error is reported as such
        return f"probe ({name}): cached replay through get_input_embeddings failed: {error_text(exc)}"
