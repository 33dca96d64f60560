"""Driving the live ``mlx_vlm.models.cohere_compass`` (upstream's or ours) the way mlx-vlm drives it,
and what the checklist-marked tests compare with the reference (tests/test_live_package.py).

Every comparison returns a list of problems, one short line each (empty: it holds), so a failing
test names every way a case is off, which is the evidence the pin-bump's verdicts carry.
"""

from __future__ import annotations

import importlib
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest

from compass_compat.vendor import vendor_root, within
from tests.support.cases import (
    LOGIT_TOL,
    N_GREEDY,
    PIXEL_TOL,
    case_inputs,
    matching_prefix,
    max_abs,
    stream_ids,
    token_list,
)
from tests.support.recorded import read_video_case
from tests.support.vendored import PACKAGE, upstream_ships

FIRST_UPSTREAM_RELEASE = "0.6.13"
QUANT_GROUP, QUANT_BITS = 64, 4
# Quantized model vs a float model holding its dequantized weights: only summation order differs.
QUANT_TWIN_TOL = 1e-3


def fmt(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.2e}"


def error_text(exc: BaseException, limit: int = 300) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:limit]


def require_package(kind: str) -> None:
    """Fail (never skip) where the implementation under test has no package: that is item 1's FAIL."""
    if kind == "upstream" and not upstream_ships():
        import mlx_vlm

        pytest.fail(
            f"no upstream cohere_compass (mlx-vlm {mlx_vlm.__version__} ships none; the first release that "
            f"does is {FIRST_UPSTREAM_RELEASE})"
        )


def live_package_dir() -> Path:
    return Path(importlib.import_module(PACKAGE).__file__ or "").resolve().parent


def check_model_source(model: Any, kind: str) -> None:
    """Fail unless ``model`` comes from the implementation under test (``kind``)."""
    file = getattr(sys.modules.get(type(model).__module__), "__file__", None)
    vendored = within(file, vendor_root())
    if vendored != (kind == "vendored"):
        pytest.fail(f"mlx_vlm.load built {type(model).__module__}.{type(model).__name__} from {file}, not {kind}'s")


def load(path: Path, kind: str) -> Tuple[Any, Any]:
    from mlx_vlm import load as mlx_vlm_load

    model, processor = mlx_vlm_load(str(path))
    check_model_source(model, kind)
    return model, processor


def prefill_logits(model: Any, ids: Any, pixel_values: Any, extra: Dict[str, Any]) -> np.ndarray:
    """Logits [L, V] of one forward pass through ``Model.__call__`` with a fresh cache."""
    cache = model.language_model.make_cache() if hasattr(model.language_model, "make_cache") else None
    out = model(ids, pixel_values, cache=cache, **extra)
    return np.array(getattr(out, "logits", out)[0], dtype=np.float32)


def greedy_ids(model: Any, ids: Any, pixel_values: Any, extra: Dict[str, Any], n: int = N_GREEDY) -> List[int]:
    """n greedy ids from mlx-vlm's own ``generate_step`` on the reference inputs."""
    from mlx_vlm.generate import generate_step

    out: List[int] = []
    for token, _ in generate_step(ids, model, pixel_values, None, max_tokens=n, temperature=0.0, **extra):
        out.append(int(token.item() if hasattr(token, "item") else token))
        if len(out) >= n:
            break
    return out


def prompt_path(model: Any, processor: Any, prompt: str, images: Sequence[str], n: int) -> Dict[str, Any]:
    """``mlx_vlm.stream_generate`` on a prompt: what the model was fed first, and the streamed ids."""
    fed: List[Dict[str, Any]] = []
    tokens = stream_ids(model, processor, prompt, images, n, fed=fed)
    if not fed:
        raise RuntimeError("stream_generate never called get_input_embeddings")
    return {"fed": fed[0], "tokens": tokens}


def expected_stream(case: Dict[str, Any], eos: Optional[int]) -> List[int]:
    """Reference greedy ids as mlx-vlm streams them: up to and including an end-of-turn id."""
    want = token_list(case["greedy_ids"])
    return want[: want.index(eos) + 1] if eos in want else want


def eos_id(folder: Path) -> Optional[int]:
    return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("eos_token_id")


def case_problems(model: Any, processor: Any, case: Dict[str, Any], images: List[str], eos: Optional[int]) -> List[str]:
    """Items 2 and 3 on one reference case: the model on the reference inputs (prefill logits,
    ``generate_step`` greedy ids, positions) and the whole prompt path through ``stream_generate``
    (ids fed with one BOS, image tokens, grid, pixels, streamed ids)."""
    meta = case["meta"]
    ids, pixels, extra = case_inputs(case)
    want_ids = token_list(case["input_ids"])
    problems: List[str] = []
    logits = prefill_logits(model, ids, pixels, extra)
    if logits.shape != case["prefill_logits"].shape:
        problems.append(f"logits shape {list(logits.shape)} vs {list(case['prefill_logits'].shape)}")
    elif not max_abs(logits, case["prefill_logits"]) <= LOGIT_TOL:
        problems.append(f"max|dlogits| {fmt(max_abs(logits, case['prefill_logits']))} (tol {fmt(LOGIT_TOL)})")
    greedy, want_greedy = greedy_ids(model, ids, pixels, extra), token_list(case["greedy_ids"])
    if greedy != want_greedy:
        problems.append(f"generate_step greedy {matching_prefix(greedy, want_greedy)}/{len(want_greedy)}")
    if pixels is not None:
        emb = model.get_input_embeddings(ids, pixels, **extra)
        positions, deltas = getattr(emb, "position_ids", None), getattr(emb, "rope_deltas", None)
        if positions is None:
            problems.append("get_input_embeddings exposes no position_ids")
        elif not np.array_equal(np.array(positions).astype(np.int64), case["position_ids"]):
            problems.append("position ids differ")
        elif deltas is None or np.array(deltas).reshape(-1).tolist() != case["rope_deltas"].reshape(-1).tolist():
            problems.append(f"rope delta {None if deltas is None else np.array(deltas).reshape(-1).tolist()}")
    try:
        run = prompt_path(model, processor, meta["prompt"], images, N_GREEDY)
    except Exception as exc:  # the error is the evidence
        return problems + [f"stream_generate: {error_text(exc)}"]
    fed = run["fed"]
    got_ids = token_list(fed["input_ids"])
    if got_ids != want_ids:
        bos = 0
        while bos < len(got_ids) and got_ids[bos] == want_ids[0]:
            bos += 1
        problems.append(
            f"prompt ids differ ({len(got_ids)} ids vs {len(want_ids)}"
            + (f", BOS x{bos} (double BOS))" if bos > 1 else ")")
        )
    if pixels is not None:
        image_token = int(np.asarray(case["input_ids"])[np.asarray(case["mm_token_type_ids"]) == 1][0])
        want_count = int(sum(meta["num_image_tokens"]))
        if got_ids.count(image_token) != want_count:
            problems.append(f"{got_ids.count(image_token)} image tokens vs {want_count}")
        grid = fed["image_grid_thw"]
        grid = None if grid is None else np.asarray(grid).reshape(-1, 3).tolist()
        if grid != case["image_grid_thw"].tolist():
            problems.append(f"grid {grid} vs {case['image_grid_thw'].tolist()}")
        got_px = fed["pixel_values"]
        if got_px is None or got_px.shape != case["pixel_values"].shape:
            problems.append(f"pixel_values shape {None if got_px is None else list(got_px.shape)}")
        elif not max_abs(got_px, case["pixel_values"]) <= PIXEL_TOL:
            problems.append(f"max|dpixels| {fmt(max_abs(got_px, case['pixel_values']))}")
    want_stream = expected_stream(case, eos)
    if run["tokens"][: len(want_stream)] != want_stream:
        problems.append(f"stream_generate greedy {matching_prefix(run['tokens'], want_stream)}/{len(want_stream)}")
    return problems


# ------------------------------------------------------------ item 3's image-files probe


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> Tuple[int, int]:
    """Target size: sides rounded to multiples of ``factor``, area within [min, max] pixels, exact arithmetic."""
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * grow / factor) * factor, math.ceil(width * grow / factor) * factor
    return h, w


SOLID_COLOUR = (200, 120, 40)


def image_files_expectations(folder: Path) -> Dict[str, Any]:
    """What the folder's files say a processor must give (exact arithmetic from their values): the
    grids of a solid 64x64 and a 640x480 image, and the solid image's normalised channels. The bounds
    are resolved as transformers resolves them (``tests.support.pixel_bounds.pixel_bounds``: processor_config.json's
    block over preprocessor_config.json, tokenizer_config.json's min/max_pixels over both)."""
    from tests.support.pixel_bounds import pixel_bounds

    bounds = pixel_bounds(folder)
    conf = bounds.image_config
    factor = conf["patch_size"] * conf["merge_size"]
    grids = {}
    for label, (h, w) in (("solid 64x64", (64, 64)), ("640x480", (480, 640))):
        th, tw = smart_resize(h, w, factor, bounds.min_pixels, bounds.max_pixels)
        grids[label] = [1, th // conf["patch_size"], tw // conf["patch_size"]]
    mean, std = np.asarray(conf["image_mean"], np.float64), np.asarray(conf["image_std"], np.float64)
    return {"grids": grids, "normalised": ((np.asarray(SOLID_COLOUR, np.float64) / 255.0 - mean) / std), "conf": conf}


def image_files_problems(model: Any, processor: Any, folder: Path, images: Dict[str, Path], prompt: str) -> List[str]:
    """Item 3's probe on the ``small_max_pixels`` checkpoint (tokenizer_config.json min 16384 / max 65536
    pixels, a non-default mean/std): through ``stream_generate``, the grids and the solid image's values
    must be what the folder's files give."""
    want = image_files_expectations(folder)
    conf = want["conf"]
    problems = []
    for label, image in images.items():
        try:
            fed = prompt_path(model, processor, prompt, [str(image)], 1)["fed"]
        except Exception as exc:  # the error is the evidence
            problems.append(f"{label}: {error_text(exc)}")
            continue
        grid = None if fed["image_grid_thw"] is None else np.asarray(fed["image_grid_thw"]).reshape(-1).tolist()
        if grid != want["grids"][label]:
            problems.append(f"{label}: grid {grid}, the file's pixel bounds give {want['grids'][label]}")
        if label.startswith("solid") and fed["pixel_values"] is not None:
            px = np.asarray(fed["pixel_values"], np.float64).reshape(
                -1, 3, conf["temporal_patch_size"], conf["patch_size"] ** 2
            )
            err = max(float(np.max(np.abs(px[:, c] - want["normalised"][c]))) for c in range(3))
            if not err <= PIXEL_TOL:
                got = [round(float(px[:, c].mean()), 4) for c in range(3)]
                problems.append(
                    f"{label}: normalised channels {got}, the file's mean/std give "
                    f"{[round(v, 4) for v in want['normalised'].tolist()]}"
                )
    return problems


# ---------------------------------------------------------------- item 8's checkpoint


def quantize_checkpoint(source: Path, workdir: Path, kind: str) -> Tuple[Path, Path, int]:
    """The tiny MLX-layout checkpoint loaded through the implementation (``mlx_vlm.utils.load_model``,
    as ``mlx_vlm convert`` does), quantized with ``mlx.nn.quantize`` (4-bit, group 64, affine; layers
    whose input width is not a multiple of 64 stay float) and saved, with its float "twin" (every
    quantized weight dequantized: exactly what the quantized model must compute). Returns
    (quantized folder, twin folder, number of quantized modules written)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_model

    model = load_model(source)
    check_model_source(model, kind)

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
    folders = (workdir / "quantized", workdir / "dequantized_twin")
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


# --------------------------------------------------------------------- item 11's cases


def video_processor_call(processor: Any, meta: Dict[str, Any], images_dir: Path) -> Dict[str, Any]:
    """A video case's prompt and clips through ``processor`` as transformers' own call takes them:
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


def stream_processed(model: Any, processor: Any, out: Dict[str, Any], n: int) -> List[int]:
    """The processor's output through mlx-vlm's ``stream_generate`` (every pin takes input ids and
    the model's inputs as keywords): the streamed greedy ids."""
    import mlx.core as mx

    kwargs = {
        key: mx.array(np.asarray(out[key]))
        for key in ("pixel_values_videos", "video_grid_thw", "image_grid_thw", "mm_token_type_ids")
        if out.get(key) is not None
    }
    pixels = out.get("pixel_values")
    mask = out.get("attention_mask")
    return stream_ids(
        model,
        processor,
        "",
        max_tokens=n,
        input_ids=mx.array(np.asarray(out["input_ids"])),
        pixel_values=None if pixels is None else mx.array(np.asarray(pixels)),
        mask=None if mask is None else mx.array(np.asarray(mask)),
        **kwargs,
    )


def video_problems(model: Any, processor: Any, path: Path, meta: Dict[str, Any], images_dir: Path) -> List[str]:
    """Item 11 on one recorded video case: the model on the reference's inputs (prefill logits,
    greedy ids, positions), then the processor on the decoded clips (prompt ids with the timestamp
    blocks, pixels, grid) and its output through ``stream_generate``."""

    case = read_video_case(path)
    problems: List[str] = []
    ids, pixels, extra = case_inputs(case)
    want_greedy = token_list(case["greedy_ids"])
    try:
        logits = prefill_logits(model, ids, pixels, extra)
        diff = max_abs(logits, case["prefill_logits"]) if logits.shape == case["prefill_logits"].shape else None
        if diff is None or not diff <= LOGIT_TOL:
            problems.append(f"max|dlogits| {fmt(diff)}")
        greedy = greedy_ids(model, ids, pixels, extra)
        if greedy != want_greedy:
            problems.append(f"generate_step greedy {matching_prefix(greedy, want_greedy)}/{N_GREEDY}")
        positions = getattr(model.get_input_embeddings(ids, pixels, **extra), "position_ids", None)
        if positions is None or not np.array_equal(np.array(positions).astype(np.int64), case["position_ids"]):
            problems.append("position ids differ")
    except Exception as exc:  # the error is the evidence
        problems.append(f"model: {error_text(exc)}")
    try:
        out = video_processor_call(processor, meta, images_dir)
    except Exception as exc:  # the error is the evidence
        return problems + [f"processor: {error_text(exc)}"]
    got_ids, want_ids = token_list(out["input_ids"]), token_list(case["input_ids"])
    if got_ids != want_ids:
        problems.append(f"prompt ids differ ({len(got_ids)} ids vs {len(want_ids)})")
    grid = out.get("video_grid_thw")
    grid = None if grid is None else np.asarray(grid).reshape(-1, 3).tolist()
    if grid != case["video_grid_thw"].tolist():
        problems.append(f"video grid {grid} vs {case['video_grid_thw'].tolist()}")
    got_px = out.get("pixel_values_videos")
    if got_px is None or np.asarray(got_px).shape != case["pixel_values_videos"].shape:
        problems.append(f"pixel_values_videos shape {None if got_px is None else list(np.asarray(got_px).shape)}")
    elif not max_abs(got_px, case["pixel_values_videos"]) <= PIXEL_TOL:
        problems.append(f"max|dpixels| {fmt(max_abs(got_px, case['pixel_values_videos']))}")
    if not problems:
        try:
            streamed = stream_processed(model, processor, out, len(want_greedy))
        except Exception as exc:  # the error is the evidence
            problems.append(f"stream_generate: {error_text(exc)}")
        else:
            if streamed != want_greedy:
                problems.append(f"stream_generate greedy {matching_prefix(streamed, want_greedy)}/{len(want_greedy)}")
    return problems
