"""Items 2 and 3: the model against the reference, on the reference inputs and through the prompt path."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np

from ..harness import LOGIT_TOL, N_GREEDY, PIXEL_TOL, Context, matching_prefix, max_abs, token_list
from ..report import FAIL, PASS, Item, ItemResult, error_text, fmt
from .base import needs_package, result
from .image_files import preprocessor_probe


def _case_parity(ctx: Context, name: str, model: Any, processor: Any) -> Dict[str, Any]:
    """Everything items 2 and 3 compare for one reference case."""
    case, meta = ctx.reference(name), ctx.reference.cases[name]
    ids, pixels, extra = ctx.model_inputs(name)
    want_ids = token_list(case["input_ids"])
    want_greedy = token_list(case["greedy_ids"])
    row: Dict[str, Any] = {"case": name, "problems": []}
    problems: List[str] = row["problems"]

    # The model on the reference inputs.
    logits = ctx.prefill_logits(model, ids, pixels, extra)
    if logits.shape != case["prefill_logits"].shape:
        row["logits_max_abs"] = None
        problems.append(f"logits shape {list(logits.shape)} vs {list(case['prefill_logits'].shape)}")
    else:
        row["logits_max_abs"] = max_abs(logits, case["prefill_logits"])
        if not row["logits_max_abs"] <= LOGIT_TOL:
            problems.append(f"max|dlogits| {fmt(row['logits_max_abs'])}")
    greedy = ctx.greedy_ids(model, ids, pixels, extra)
    row["greedy_matching"] = matching_prefix(greedy, want_greedy)
    if greedy != want_greedy:
        problems.append(f"generate_step greedy {row['greedy_matching']}/{len(want_greedy)}")

    if pixels is not None:
        emb = model.get_input_embeddings(ids, pixels, **extra)
        positions = getattr(emb, "position_ids", None)
        if positions is None:
            row["positions_equal"] = False
            problems.append("get_input_embeddings exposes no position_ids")
        else:
            got = np.array(positions).astype(np.int64)
            row["positions_equal"] = got.shape == case["position_ids"].shape and bool(
                np.array_equal(got, case["position_ids"])
            )
            deltas = getattr(emb, "rope_deltas", None)
            row["rope_delta_equal"] = (
                deltas is not None and np.array(deltas).reshape(-1).tolist() == case["rope_deltas"].reshape(-1).tolist()
            )
            if not row["positions_equal"]:
                problems.append("position ids differ")
            elif not row["rope_delta_equal"]:
                problems.append(
                    f"rope delta {np.array(deltas).reshape(-1).tolist() if deltas is not None else None}"
                    f" vs {case['rope_deltas'].reshape(-1).tolist()}"
                )

    # The whole prompt path, as a host runs it.
    try:
        run = ctx.prompt_path(model, processor, meta["prompt"], ctx.reference.image_paths(name), N_GREEDY)
    except Exception as exc:  # the error is the evidence
        row["prompt_path_error"] = error_text(exc)
        problems.append(f"stream_generate: {row['prompt_path_error']}")
        return row
    fed = run["fed"]
    got_ids = token_list(fed["input_ids"])
    bos = want_ids[0]
    row["bos_count"] = _count_leading(got_ids, bos)
    row["ids_equal"] = got_ids == want_ids
    if not row["ids_equal"]:
        detail = f"{len(got_ids)} ids vs {len(want_ids)}"
        if row["bos_count"] > 1:
            detail += f", BOS x{row['bos_count']} (double BOS)"
        problems.append(f"prompt ids differ ({detail})")
    if pixels is not None:
        image_token = int(np.asarray(case["input_ids"])[np.asarray(case["mm_token_type_ids"]) == 1][0])
        row["image_tokens"] = got_ids.count(image_token)
        row["image_tokens_expected"] = int(sum(meta["num_image_tokens"]))
        if row["image_tokens"] != row["image_tokens_expected"]:
            problems.append(f"{row['image_tokens']} image tokens vs {row['image_tokens_expected']}")
        grid = fed["image_grid_thw"]
        row["grid"] = None if grid is None else np.asarray(grid).reshape(-1, 3).tolist()
        if row["grid"] != case["image_grid_thw"].tolist():
            problems.append(f"grid {row['grid']} vs {case['image_grid_thw'].tolist()}")
        got_px = fed["pixel_values"]
        if got_px is None or got_px.shape != case["pixel_values"].shape:
            row["pixels_max_abs"] = None
            problems.append(
                f"pixel_values shape {None if got_px is None else list(got_px.shape)} "
                f"vs {list(case['pixel_values'].shape)}"
            )
        else:
            row["pixels_max_abs"] = max_abs(got_px, case["pixel_values"])
            if not row["pixels_max_abs"] <= PIXEL_TOL:
                problems.append(f"max|dpixels| {fmt(row['pixels_max_abs'])}")
    want_stream = ctx.expected_stream(name)
    row["stream_matching"] = matching_prefix(run["tokens"], want_stream)
    if run["tokens"][: len(want_stream)] != want_stream:
        problems.append(f"stream_generate greedy {row['stream_matching']}/{len(want_stream)}")
    return row


def _count_leading(ids: Sequence[int], token: int) -> int:
    n = 0
    while n < len(ids) and ids[n] == token:
        n += 1
    return n


def _summarize_cases(rows: List[Dict[str, Any]], image: bool) -> str:
    logits = [r["logits_max_abs"] for r in rows if r.get("logits_max_abs") is not None]
    parts = []
    if logits:
        parts.append(f"reference inputs: max|dlogits| {fmt(max(logits))} (tol {fmt(LOGIT_TOL)})")
    greedy = [r.get("greedy_matching", 0) for r in rows]
    parts.append(f"generate_step greedy {min(greedy)}/{N_GREEDY} worst")
    if image:
        parts.append(f"positions equal {sum(bool(r.get('positions_equal')) for r in rows)}/{len(rows)}")
        pixels = [r.get("pixels_max_abs") for r in rows if r.get("pixels_max_abs") is not None]
        if pixels:
            parts.append(f"prompt path: max|dpixels| {fmt(max(pixels))} (tol {fmt(PIXEL_TOL)})")
    ids_ok = sum(bool(r.get("ids_equal")) for r in rows)
    parts.append(f"prompt ids = reference {ids_ok}/{len(rows)}")
    stream = [r.get("stream_matching", 0) for r in rows]
    parts.append(f"stream_generate greedy {min(stream)}/{N_GREEDY} worst")
    text = "; ".join(parts)
    bad = [r for r in rows if r["problems"]]
    if bad:
        text += "\nproblems: " + "; ".join(f"{r['case']}: {', '.join(r['problems'])}" for r in bad)
    return text


@needs_package
def check_text(ctx: Context, item: Item) -> ItemResult:
    """Item 2: every text case, on the reference ids and through the prompt path."""
    model, processor = ctx.load(ctx.checkpoint("original"))
    rows = [_case_parity(ctx, name, model, processor) for name in ctx.reference.names("text")]
    verdict = PASS if not any(r["problems"] for r in rows) else FAIL
    return result(
        ctx, item, verdict, f"{len(rows)} text cases; " + _summarize_cases(rows, image=False), {"cases": rows}
    )


@needs_package
def check_image(ctx: Context, item: Item) -> ItemResult:
    """Item 3: every image case, plus the preprocessor_config.json probe."""
    model, processor = ctx.load(ctx.checkpoint("original"))
    rows = [_case_parity(ctx, name, model, processor) for name in ctx.reference.names("image")]
    probe = preprocessor_probe(ctx)
    ok = not any(r["problems"] for r in rows) and not probe["problems"]
    evidence = f"{len(rows)} image cases; " + _summarize_cases(rows, image=True)
    if probe["problems"]:
        evidence += "\nimage files not honoured: " + "; ".join(probe["problems"])
    else:
        evidence += (
            "\nimage files honoured (tokenizer_config.json min/max pixels, preprocessor_config.json "
            "mean/std; exact arithmetic)"
        )
    return result(ctx, item, PASS if ok else FAIL, evidence, {"cases": rows, "preprocessor_config": probe})
