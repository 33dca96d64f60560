"""What a video clip costs: ours (vendored, MLX) against transformers (torch CPU) on the full-size
stand-in checkpoint, bfloat16.

    .venvs/mlxvlm-0.7.10/bin/python scripts/bench/video.py                 # 16 frames, 448x448
    .venvs/mlxvlm-0.7.10/bin/python scripts/bench/video.py --frames 4      # a shorter clip

The clip is ``compass_data.clips.make_clip(frames, size, size)``. Our processor (the vendored
one, as ``mlx_vlm.load`` builds it for the stand-in folder) turns it into the prompt ids (the
timestamped blocks), ``pixel_values_videos`` and ``video_grid_thw``; both implementations get
exactly those inputs (the torch side from the saved arrays: transformers' own video processor
needs torchvision, which the matrix environments lack; tests/test_video_processor.py shows the
two processors agree bit for bit). Each implementation runs in its own worker process of the
mlx-vlm 0.7.10 environment (ours forced with ``COMPASS_COMPAT_FORCE_VENDORED=1``; torch 2.13 CPU,
sdpa, all cores), one after the other. Measured, as medians over ``--runs`` (default 1: a
16-frame clip on a 2-core CPU takes tens of minutes through MLX):

- preprocess: our processor on the clip (frames to ids and pixels; ours only);
- vision: the tower on all the clip's temporal patches (``encode_video`` / ``get_video_features``);
- prefill: time to first token of the whole video prompt, fresh cache (vision included);
- per frame: prefill / frames, and the prompt's video tokens per frame.

Writes benchmarks/results/video-<stamp>.json and .md and prints the markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]

TAG = "BENCH-JSON "
PROMPT = "Describe what happens in this video."


def log(msg: str) -> None:
    print(f"[bench-video {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _timed(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def ours(checkpoint: str, inputs: str, frames: int, size: int, runs: int) -> dict:
    """The vendored model in this process (COMPASS_COMPAT_FORCE_VENDORED=1 is set by the parent)."""
    import mlx.core as mx
    from mlx_vlm import load

    import compass_compat
    from compass_data.clips import make_clip

    model, processor = load(checkpoint)
    mx.eval(model.parameters())
    if compass_compat.implementation_info().implementation != "vendored":
        raise SystemExit("ours: the vendored cohere_compass is not live")
    clip = make_clip(frames, size, size, 0)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    meta = [{"total_num_frames": frames, "fps": 2.0, "frames_indices": list(range(frames))}]

    def preprocess():
        return processor(
            text=[text], videos=[clip], video_metadata=meta, do_sample_frames=False, cap_pixels_per_frame=False
        )

    out = preprocess()
    preprocess_s = _timed(preprocess, runs)
    ids = np.asarray(out["input_ids"]).astype(np.int32)
    pv = np.asarray(out["pixel_values_videos"], np.float32)
    grid = np.asarray(out["video_grid_thw"]).astype(np.int64)
    types = np.asarray(out["mm_token_type_ids"]).astype(np.int64)
    np.savez(inputs, ids=ids, pv=pv, grid=grid, types=types)
    kw = {"video_grid_thw": mx.array(grid), "mm_token_type_ids": mx.array(types)}

    def vision():
        mx.eval(model.encode_video(mx.array(pv), grid))

    def prefill():
        cache = model.language_model.make_cache()
        logits = model(mx.array(ids), None, cache=cache, pixel_values_videos=mx.array(pv), logits_to_keep=1, **kw)
        mx.eval(logits.logits)

    return {
        "preprocess_s": preprocess_s,
        "vision_s": _timed(vision, runs),
        "prefill_s": _timed(prefill, runs),
        "prompt_tokens": int(ids.shape[1]),
        "video_tokens": int((types == 2).sum()),
        "grid": grid.tolist(),
        "peak_memory_gb": mx.get_peak_memory() / 1e9 if hasattr(mx, "get_peak_memory") else None,
    }


def torch_side(checkpoint: str, inputs: str, runs: int) -> dict:
    import torch
    from transformers import CohereCompassForConditionalGeneration

    torch.set_num_threads(os.cpu_count() or 1)
    model = CohereCompassForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).eval()
    data = np.load(inputs)
    ids = torch.from_numpy(data["ids"].astype(np.int64))
    pv = torch.from_numpy(data["pv"]).to(torch.bfloat16)
    grid = torch.from_numpy(data["grid"])
    types = torch.from_numpy(data["types"])

    def vision():
        with torch.no_grad():
            model.model.get_video_features(pv, grid)

    def prefill():
        model.model.rope_deltas = None
        with torch.no_grad():
            model(input_ids=ids, pixel_values_videos=pv, video_grid_thw=grid, mm_token_type_ids=types, logits_to_keep=1)

    return {"vision_s": _timed(vision, runs), "prefill_s": _timed(prefill, runs), "threads": torch.get_num_threads()}


def worker(argv) -> None:
    args = json.loads(argv[0])
    if args["impl"] == "ours":
        result = ours(args["checkpoint"], args["inputs"], args["frames"], args["size"], args["runs"])
    else:
        result = torch_side(args["checkpoint"], args["inputs"], args["runs"])
    print(TAG + json.dumps(result), flush=True)


def run_worker(impl: str, **args) -> dict:
    env = dict(os.environ)
    env.pop("COMPASS_COMPAT_FORCE_VENDORED", None)
    if impl == "ours":
        env["COMPASS_COMPAT_FORCE_VENDORED"] = "1"
    log(f"{impl}: starting")
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps({"impl": impl, **args})],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    line = next((row for row in proc.stdout.splitlines() if row.startswith(TAG)), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{impl} worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(line[len(TAG) :])
    log(f"{impl}: {result}")
    return result


def markdown(result: dict) -> str:
    o, t, frames = result["ours"], result["torch"], result["frames"]
    rows = [
        ("preprocess: frames to ids and pixels (s)", o["preprocess_s"], None),
        ("vision tower, whole clip (s)", o["vision_s"], t["vision_s"]),
        ("prefill to first token, whole clip (s)", o["prefill_s"], t["prefill_s"]),
        ("prefill per frame (s)", o["prefill_s"] / frames, t["prefill_s"] / frames),
    ]
    lines = [
        f"# Video benchmark {result['stamp']}",
        "",
        f"{frames} frames of {result['size']}x{result['size']} (grid {o['grid']}), "
        f"{o['prompt_tokens']}-token prompt of which {o['video_tokens']} video tokens "
        f"({o['video_tokens'] / frames:g} per frame); full-size stand-in, bfloat16; "
        f"median of {result['runs']} run(s); load average {result['load_before']} before; commit {result['commit']}.",
        "",
        "| metric | ours (MLX, CPU) | transformers (torch CPU) | ours / torch |",
        "|---|---|---|---|",
    ]
    for name, a, b in rows:
        ratio = f"{a / b:.2f}" if b else "—"
        lines.append(f"| {name} | {a:.3f} | {'—' if b is None else f'{b:.3f}'} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--dir", help="stand-in checkpoint cache (default: scripts/bench/build_fullsize.py's)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()
    from scripts.bench import build_fullsize

    checkpoint = build_fullsize.ensure_checkpoint("bf16", args.dir)
    torch_folder = build_fullsize.ensure_torch_layout(args.dir)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    result = {
        "stamp": stamp,
        "frames": args.frames,
        "size": args.size,
        "runs": args.runs,
        "load_before": round(os.getloadavg()[0], 2),
        "commit": commit.stdout.strip(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        inputs = str(pathlib.Path(tmp) / "inputs.npz")
        common = {"inputs": inputs, "frames": args.frames, "size": args.size, "runs": args.runs}
        result["ours"] = run_worker("ours", checkpoint=str(checkpoint), **common)
        result["torch"] = run_worker("torch", checkpoint=str(torch_folder), **common)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"video-{stamp}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    (out / f"video-{stamp}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
