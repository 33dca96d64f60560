"""Item 11: the video path against the reference, on the reference inputs and through the processor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from ..harness import LOGIT_TOL, N_GREEDY, PIXEL_TOL, Context, matching_prefix, max_abs, read_video_case, token_list
from ..report import FAIL, PASS, CouldNotRun, Item, ItemResult, error_text, fmt
from .base import needs_package, result

VIDEO_DIR = "video_model"  # under the fixtures directory: scripts/reference/video_model.py
CHECKPOINT = "tiny"


def video_reference(ctx: Context) -> Dict[str, Any]:
    """index.json of the recorded video cases on the tiny checkpoint."""
    index = ctx.reference.directory / VIDEO_DIR / "index.json"
    if not index.is_file():
        raise CouldNotRun(f"video reference fixtures not found: {index} does not exist")
    return json.loads(index.read_text(encoding="utf-8"))["checkpoints"][CHECKPOINT]


def _case_arrays(ctx: Context, meta: Dict[str, Any]) -> Dict[str, np.ndarray]:
    return read_video_case(Path(ctx.reference.directory) / VIDEO_DIR / CHECKPOINT / meta["file"])


def _processor_call(processor: Any, meta: Dict[str, Any], images_dir: Path) -> Dict[str, Any]:
    """The case's prompt and clips through ``processor`` as transformers' own call takes them:
    decoded frames with their metadata, frames used as given (``do_sample_frames=False``)."""
    from PIL import Image

    from compass_data.clips import make_clip

    frames = [make_clip(*v["shape"]) for v in meta["videos"]]
    kwargs: Dict[str, Any] = {
        "videos": frames,
        "video_metadata": [
            {"fps": v["fps"], "total_num_frames": len(f), "frames_indices": list(range(len(f)))}
            for f, v in zip(frames, meta["videos"])
        ],
        "do_sample_frames": False,
        "cap_pixels_per_frame": False,
    }
    if meta["images"]:
        kwargs["images"] = [Image.open(images_dir / name).convert("RGB") for name in meta["images"]]
    return processor(text=[meta["prompt"]], add_special_tokens=False, **kwargs)


def _video_case(ctx: Context, name: str, meta: Dict[str, Any], model: Any, processor: Any) -> Dict[str, Any]:
    import mlx.core as mx

    case = _case_arrays(ctx, meta)
    row: Dict[str, Any] = {"case": name, "problems": []}
    problems: List[str] = row["problems"]
    ids = mx.array(case["input_ids"])
    extra: Dict[str, Any] = {
        "pixel_values_videos": mx.array(case["pixel_values_videos"]),
        "video_grid_thw": mx.array(case["video_grid_thw"]),
        "mm_token_type_ids": mx.array(case["mm_token_type_ids"]),
    }
    pixels = None
    if "pixel_values" in case:
        pixels = mx.array(case["pixel_values"])
        extra["image_grid_thw"] = mx.array(case["image_grid_thw"])
    want_greedy = token_list(case["greedy_ids"])

    # The model on the reference's own inputs.
    try:
        logits = ctx.prefill_logits(model, ids, pixels, extra)
        row["logits_max_abs"] = (
            max_abs(logits, case["prefill_logits"]) if logits.shape == case["prefill_logits"].shape else None
        )
        if row["logits_max_abs"] is None or not row["logits_max_abs"] <= LOGIT_TOL:
            problems.append(f"max|dlogits| {fmt(row['logits_max_abs'])}")
        greedy = ctx.greedy_ids(model, ids, pixels, extra)
        row["greedy_matching"] = matching_prefix(greedy, want_greedy)
        if greedy != want_greedy:
            problems.append(f"generate_step greedy {row['greedy_matching']}/{N_GREEDY}")
        emb = model.get_input_embeddings(ids, pixels, **extra)
        positions = getattr(emb, "position_ids", None)
        row["positions_equal"] = positions is not None and bool(
            np.array_equal(np.array(positions).astype(np.int64), case["position_ids"])
        )
        if not row["positions_equal"]:
            problems.append("position ids differ")
    except Exception as exc:  # the error is the evidence
        problems.append(f"model: {error_text(exc)}")

    # The processor: the frames and their times to ids, pixels and grid.
    try:
        out = _processor_call(processor, meta, ctx.reference.images_dir)
    except Exception as exc:
        problems.append(f"processor: {error_text(exc)}")
        return row
    got_ids = token_list(out["input_ids"])
    want_ids = token_list(case["input_ids"])
    row["ids_equal"] = got_ids == want_ids
    if not row["ids_equal"]:
        problems.append(f"prompt ids differ ({len(got_ids)} ids vs {len(want_ids)})")
    grid = out.get("video_grid_thw")
    row["grid"] = None if grid is None else np.asarray(grid).reshape(-1, 3).tolist()
    if row["grid"] != case["video_grid_thw"].tolist():
        problems.append(f"video grid {row['grid']} vs {case['video_grid_thw'].tolist()}")
    got_px = out.get("pixel_values_videos")
    if got_px is None or np.asarray(got_px).shape != case["pixel_values_videos"].shape:
        row["pixels_max_abs"] = None
        problems.append(f"pixel_values_videos shape {None if got_px is None else list(np.asarray(got_px).shape)}")
    else:
        row["pixels_max_abs"] = max_abs(got_px, case["pixel_values_videos"])
        if not row["pixels_max_abs"] <= PIXEL_TOL:
            problems.append(f"max|dpixels| {fmt(row['pixels_max_abs'])}")
    if not problems:
        # The processor's output through mlx-vlm's stream_generate (every pin takes input ids and
        # the model's inputs as keywords): the streamed ids must be the reference's.
        try:
            row["stream_matching"] = matching_prefix(_stream(model, processor, out, len(want_greedy)), want_greedy)
        except Exception as exc:
            problems.append(f"stream_generate: {error_text(exc)}")
        else:
            if row["stream_matching"] != len(want_greedy):
                problems.append(f"stream_generate greedy {row['stream_matching']}/{len(want_greedy)}")
    return row


def _stream(model: Any, processor: Any, out: Dict[str, Any], n: int) -> List[int]:
    import mlx.core as mx
    from mlx_vlm import stream_generate

    kwargs = {
        key: mx.array(np.asarray(out[key]))
        for key in ("pixel_values_videos", "video_grid_thw", "image_grid_thw", "mm_token_type_ids")
        if out.get(key) is not None
    }
    pixels = out.get("pixel_values")
    seen: Dict[int, int] = {}
    for res in stream_generate(
        model,
        processor,
        "",
        input_ids=mx.array(np.asarray(out["input_ids"])),
        pixel_values=None if pixels is None else mx.array(np.asarray(pixels)),
        mask=mx.array(np.asarray(out["attention_mask"])) if out.get("attention_mask") is not None else None,
        max_tokens=n,
        temperature=0.0,
        **kwargs,
    ):
        seen.setdefault(int(res.generation_tokens), int(res.token))  # 0.3.x repeats the last token
    return [seen[k] for k in sorted(seen)]


@needs_package
def check_video(ctx: Context, item: Item) -> ItemResult:
    """Item 11: every recorded video case, on the reference inputs and through the processor."""
    cases = video_reference(ctx)
    model, processor = ctx.load(ctx.checkpoint("original"))
    rows = [_video_case(ctx, name, meta, model, processor) for name, meta in cases.items()]
    logits = [r["logits_max_abs"] for r in rows if r.get("logits_max_abs") is not None]
    parts = [f"{len(rows)} video cases"]
    if logits:
        parts.append(f"reference inputs: max|dlogits| {fmt(max(logits))} (tol {fmt(LOGIT_TOL)})")
    parts.append(f"positions equal {sum(bool(r.get('positions_equal')) for r in rows)}/{len(rows)}")
    parts.append(f"processor ids = reference (timestamps) {sum(bool(r.get('ids_equal')) for r in rows)}/{len(rows)}")
    pixels = [r["pixels_max_abs"] for r in rows if r.get("pixels_max_abs") is not None]
    if pixels:
        parts.append(f"max|dpixels| {fmt(max(pixels))} (tol {fmt(PIXEL_TOL)})")
    evidence = "; ".join(parts)
    bad = [r for r in rows if r["problems"]]
    if bad:
        evidence += "\nproblems: " + "; ".join(f"{r['case']}: {', '.join(r['problems'])}" for r in bad)
    return result(ctx, item, FAIL if bad else PASS, evidence, {"cases": rows})
