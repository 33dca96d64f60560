"""Record what transformers' cohere_compass does with video, for the torch-free processor's tests.

transformers' ``CohereCompassVideoProcessor`` needs torchvision, so this runs in the recording
environment only (``scripts/env/reference.sh``: torch 2.14.1 + torchvision 0.29.1 +
transformers 5.24.0, CPU, one thread):

    .venvs/reference-video/bin/python scripts/reference/video_processor.py

It builds the tiny checkpoint (``compass_data.tiny``, original layout) and the settings
variants the cases name, loads ``AutoProcessor.from_pretrained`` on each (transformers' own
processor: tokenizer, image processor, video processor), draws the clips with
``compass_data.clips.make_clip`` (tests draw them again; each clip's sha256 is recorded) and,
per case, renders the case's messages with the chat template and calls the processor on the
rendered text (``add_special_tokens=False``: the template writes BOS). Written to
tests/fixtures/video/:

- ``<case>.npz`` (zip entries at a fixed date, so re-runs give identical bytes): ``input_ids``,
  ``mm_token_type_ids``, ``video_grid_thw``, ``pixel_values_videos`` packed losslessly
  (``pixel_codes`` uint8 [N, 3*2*16*16] into ``pixel_levels`` [3, 256] float32 per channel:
  every value comes from one uint8 sample of its channel, resized or not), and for image cases
  ``image_grid_thw``, ``image_codes`` / ``image_levels``;
- ``index.json``: versions, the clips (parameters, sha256), and per case its messages, call,
  settings variant, the rendered prompt, the expanded prompt with pad runs collapsed, the
  timestamps, the frames the reference sampled, whether it resized, and the warnings it logged.

One function per kind of case (``record_processor_case``; model cases - logits, greedy ids -
can be added as another kind). Checks made while recording: pixel packing is lossless;
equivalent calls (PIL frames, channels-first arrays, pre-sampled frames with their indices,
``apply_chat_template(tokenize=True)``) give the same outputs as the case's own call.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import logging
import pathlib
import re
import shutil
import tempfile
import zipfile
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from compass_data import clips, tiny
from tests.support import reference as _reference
from tests.support.pixels import pack_levels
from tests.support.video_processor import VARIANTS, write_variant

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "tests" / "fixtures" / "video"
FORMAT = 1
VIDEO = {"type": "video"}
IMAGE = {"type": "image"}


def user(*parts) -> List[dict]:
    content = [dict(p) if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def meta(total: int, fps=None, indices=None) -> dict:
    out = {"total_num_frames": total}
    if fps is not None:
        out["fps"] = fps
    if indices is not None:
        out["frames_indices"] = list(indices)
    return out


# --------------------------------------------------------------------------- cases
# clips: (frames, height, width, seed) per video, drawn by compass_data.clips.make_clip.
# call: the reference call's keywords; ours: where our call differs (documented departures).
# image: (height, width, seed) of a still (frame 0 of such a clip) for image + video cases.
# also: equivalent inputs checked to give the same reference output (see _alternatives).
CASES: Dict[str, dict] = {
    "frames_no_metadata": dict(
        clips=[(8, 64, 96, 1)],
        messages=user(VIDEO, "What happens?"),
        call={},  # do_sample_frames is on by default: fps 2 of an assumed 24 fps clip
        also=["pil", "channels_first"],
    ),
    "frames_no_sampling": dict(
        clips=[(8, 128, 128, 1)],
        messages=user(VIDEO, "What happens?"),
        call=dict(do_sample_frames=False),  # timestamps at an assumed 24 fps
        also=["pil", "channels_first"],
    ),
    "short_clip_3": dict(
        clips=[(3, 64, 96, 3)],  # fewer frames than min_frames: all 3 kept, padded to 4
        messages=user(VIDEO, "What happens?"),
        call=dict(video_metadata=[meta(3, 30)]),
    ),
    "odd_count_5": dict(
        clips=[(5, 128, 128, 3)],
        messages=user("Watch:", VIDEO),
        call=dict(do_sample_frames=False, video_metadata=[meta(5, 10, range(5))]),
    ),
    "sample_24fps": dict(
        clips=[(60, 64, 96, 2)],
        messages=user(VIDEO, "Describe the motion."),
        call=dict(video_metadata=[meta(60, 24)]),
        also=["channels_first"],
    ),
    "sample_30fps": dict(
        clips=[(60, 128, 160, 4)],
        messages=user(VIDEO, "Describe the motion."),
        call=dict(video_metadata=[meta(60, 30)]),
    ),
    "sample_30fps_at_4": dict(
        clips=[(60, 128, 160, 4)],
        messages=user(VIDEO, "Describe the motion."),
        call=dict(video_metadata=[meta(60, 30)], fps=4),
    ),
    "num_frames_7": dict(
        clips=[(60, 64, 96, 5)],
        messages=user(VIDEO, "Describe the motion."),
        call=dict(video_metadata=[meta(60, 30)], num_frames=7, fps=None),  # the reference needs fps=None
        ours=dict(video_metadata=[meta(60, 30)], num_frames=7),
    ),
    "metadata_without_fps": dict(
        clips=[(60, 64, 96, 2)],
        messages=user(VIDEO, "Describe the motion."),
        call=dict(video_metadata=[meta(60)]),
    ),
    "max_frames_768": dict(
        clips=[(800, 32, 32, 6)],
        messages=user(VIDEO, "How long is it?"),
        call=dict(video_metadata=[meta(800, 1)], cap_pixels_per_frame=False),  # 1600 asked, 768 kept
    ),
    # The same length within a small pixel budget (the settings file's 262144 pixels, 8 tokens a
    # frame): uncapped, 768 frames share the budget (64x64 -> 32x32); capped, each frame keeps
    # 1.05 * 4096 pixels (64x64 stays).
    "max_frames_768_small_budget": dict(
        variant="video_preprocessor_config",
        clips=[(800, 64, 64, 6)],
        messages=user(VIDEO, "How long is it?"),
        call=dict(video_metadata=[meta(800, 1)], cap_pixels_per_frame=False),
    ),
    "max_frames_768_small_budget_capped": dict(
        variant="video_preprocessor_config",
        clips=[(800, 64, 64, 6)],
        messages=user(VIDEO, "How long is it?"),
        call=dict(video_metadata=[meta(800, 1)], cap_pixels_per_frame=True),
    ),
    "large_frames_cap_unset": dict(
        clips=[(2, 800, 1024, 7)],  # 800x1024 keeps its size uncapped (no resize)
        messages=user(VIDEO, "What is shown?"),
        call=dict(do_sample_frames=False),
    ),
    "large_frames_cap_false": dict(
        clips=[(2, 800, 1024, 7)],
        messages=user(VIDEO, "What is shown?"),
        call=dict(do_sample_frames=False, cap_pixels_per_frame=False),
    ),
    "large_frames_capped": dict(
        clips=[(2, 800, 1024, 7)],  # over max_video_tokens * 32**2 pixels a frame: resized down
        messages=user(VIDEO, "What is shown?"),
        call=dict(do_sample_frames=False, cap_pixels_per_frame=True),
    ),
    "large_frames_capped_100_tokens": dict(
        load=dict(max_video_tokens=100),  # the reference reads max_video_tokens from the instance only
        clips=[(2, 800, 1024, 7)],
        messages=user(VIDEO, "What is shown?"),
        call=dict(do_sample_frames=False, cap_pixels_per_frame=True),
    ),
    "two_videos": dict(
        clips=[(8, 64, 96, 8), (6, 96, 64, 9)],
        messages=user("First:", VIDEO, "Second:", VIDEO, "Which one moves faster?"),
        call=dict(video_metadata=[meta(8, 4, range(8)), meta(6, 3, range(6))], do_sample_frames=False),
        also=["apply_chat_template"],
    ),
    "image_and_video": dict(
        clips=[(12, 96, 128, 10)],
        image=(160, 128, 11),
        messages=user(IMAGE, "Here is the first frame.", VIDEO, "What changes?"),
        call=dict(video_metadata=[meta(12, 6)]),
        also=["apply_chat_template"],
    ),
    "loader_contract": dict(
        # What mlx-vlm 0.7.x hands over after sampling with sample_frames: the reference sampling the
        # whole clip, and (checked equal) the sampled frames with their source indices.
        clips=[(90, 64, 96, 12)],
        messages=user(VIDEO, "What happens?"),
        call=dict(video_metadata=[meta(90, 30)]),
        also=["presampled"],
    ),
    "settings_video_preprocessor_config": dict(
        variant="video_preprocessor_config",
        clips=[(16, 128, 160, 13)],
        messages=user(VIDEO, "What happens?"),
        call=dict(video_metadata=[meta(16, 8)], fps=8, cap_pixels_per_frame=False),
    ),
    "settings_video_preprocessor_config_capped": dict(
        variant="video_preprocessor_config",
        clips=[(16, 128, 160, 13)],
        messages=user(VIDEO, "What happens?"),
        call=dict(video_metadata=[meta(16, 8)], fps=8, cap_pixels_per_frame=True),
    ),
    "settings_processor_config_block": dict(
        variant="processor_config_video_block",
        clips=[(16, 128, 160, 13)],
        messages=user(VIDEO, "What happens?"),
        call=dict(video_metadata=[meta(16, 8)]),
    ),
    "settings_tokenizer_keys": dict(
        variant="tokenizer_video_keys",
        clips=[(8, 64, 96, 1)],
        messages=user(VIDEO, "What happens?"),
        call=dict(video_metadata=[meta(8, 2)]),
    ),
    "load_max_frames_6": dict(
        load=dict(max_frames=6, max_video_tokens=100),  # read from the instance by the reference
        clips=[(60, 64, 96, 2)],
        messages=user(VIDEO, "Describe the motion."),
        call=dict(video_metadata=[meta(60, 30)], fps=10),
    ),
}


# --------------------------------------------------------------------------- files
def save_npz(path: pathlib.Path, arrays: Dict[str, np.ndarray]) -> None:
    """np.savez_compressed with fixed zip dates: the same arrays give the same bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for name in sorted(arrays):
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, buffer.getvalue(), compresslevel=9)


# --------------------------------------------------------------------------- the reference
class Reference:
    """transformers' AutoProcessor for each settings variant (and load keywords) of the tiny checkpoint."""

    def __init__(self, workdir: pathlib.Path):
        self.workdir = workdir
        self.base = tiny.build_tiny_checkpoint(workdir / "tiny", layout="original", dtype="float32")
        self._processors: Dict[str, object] = {}

    def folder(self, variant: str) -> pathlib.Path:
        if variant == "default":
            return self.base
        folder = self.workdir / variant
        if not folder.exists():
            shutil.copytree(self.base, folder)
            write_variant(folder, variant)
        return folder

    def processor(self, variant: str = "default", load: Optional[dict] = None):
        key = json.dumps([variant, load or {}], sort_keys=True)
        if key not in self._processors:
            from transformers import AutoProcessor

            self._processors[key] = AutoProcessor.from_pretrained(self.folder(variant), **(load or {}))
        return self._processors[key]


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def reference_warnings(messages: List[str]) -> List[str]:
    """Which of the reference's video warnings fired (short names, as tests check them)."""
    names = {
        "no_fps_sampling": "Asked to sample `fps` frames per second but no video metadata",
        "no_fps_timestamps": "requires frame timestamps to construct prompts",
        "uncapped": "does not apply the per-frame pixel cap",
    }
    return sorted(name for name, text in names.items() if any(text in m for m in messages))


def clip_frames(spec: Sequence[int]) -> np.ndarray:
    return clips.make_clip(*spec)


def collapse_runs(text: str) -> str:
    """The expanded prompt with runs of pad tokens written as ``<|VIDEO_PAD|>x40``."""
    return re.sub(
        r"((<\|VIDEO_PAD\|>|<\|IMAGE_PAD\|>))\1+", lambda m: f"{m.group(1)}x{len(m.group(0)) // len(m.group(1))}", text
    )


def _call(processor, case: dict, videos, text, **overrides):
    import torch

    kwargs = copy.deepcopy(case["call"])
    kwargs.update(overrides)
    images = None
    if "image" in case:
        h, w, seed = case["image"]
        images = [clips.make_clip(1, h, w, seed)[0]]
    with torch.no_grad():
        return processor(
            text=[text],
            videos=videos,
            images=images,
            add_special_tokens=False,
            return_tensors="np",
            return_metadata=True,
            **kwargs,
        )


def _same(a, b, what: str) -> None:
    for key in ("input_ids", "video_grid_thw", "pixel_values_videos"):
        if not np.array_equal(np.asarray(a[key]), np.asarray(b[key])):
            raise SystemExit(f"{what}: {key} differs from the case's own call")


def _alternatives(processor, case: dict, frames: List[np.ndarray], text: str, out) -> List[str]:
    """Check the equivalent inputs ``case["also"]`` names; returns the names checked."""
    from PIL import Image

    checked = []
    for name in case.get("also", []):
        if name == "pil":
            other = _call(processor, case, [[Image.fromarray(f) for f in v] for v in frames], text)
        elif name == "channels_first":
            other = _call(processor, case, [np.ascontiguousarray(v.transpose(0, 3, 1, 2)) for v in frames], text)
        elif name == "presampled":
            sampled = [m["frames_indices"] for m in out["video_metadata"]]
            metadata = [
                meta(m["total_num_frames"], m["fps"], [int(i) for i in idx])
                for m, idx in zip(out["video_metadata"], sampled)
            ]
            other = _call(
                processor,
                case,
                [v[np.asarray(idx)] for v, idx in zip(frames, sampled)],
                text,
                video_metadata=metadata,
                do_sample_frames=False,
            )
        elif name == "apply_chat_template":
            messages = copy.deepcopy(case["messages"])
            videos = iter(frames)
            for message in messages:
                for part in message["content"]:
                    if part.get("type") == "video":
                        part["video"] = next(videos)
                    elif part.get("type") == "image":
                        h, w, seed = case["image"]
                        part["image"] = clips.make_clip(1, h, w, seed)[0]
            other = processor.apply_chat_template(
                messages,
                tokenize=True,
                return_dict=True,
                add_generation_prompt=True,
                return_tensors="np",
                processor_kwargs=copy.deepcopy(case["call"]),
            )
        else:
            raise SystemExit(f"unknown alternative {name!r}")
        _same(out, other, f"{name} input")
        checked.append(name)
    return checked


def record_processor_case(reference: Reference, name: str, case: dict) -> Tuple[Dict[str, np.ndarray], dict]:
    """transformers' processor outputs for one processor case, and what the index says of it."""
    from transformers.utils import logging as tf_logging

    processor = reference.processor(case.get("variant", "default"), case.get("load"))
    tokenizer = processor.tokenizer
    prompt = tokenizer.apply_chat_template(case["messages"], tokenize=False, add_generation_prompt=True)
    frames = [clip_frames(spec) for spec in case["clips"]]
    capture = LogCapture()
    tf_logging.warning_once.cache_clear()  # the reference warns once per process; once per case here
    tf_logging.disable_default_handler()  # its warnings go to the capture, not the console
    logger = tf_logging.get_logger("transformers")
    logger.addHandler(capture)
    try:
        out = _call(processor, case, frames, prompt)
        checked = _alternatives(processor, case, frames, prompt, out)
    finally:
        logger.removeHandler(capture)
        tf_logging.enable_default_handler()

    ids = np.asarray(out["input_ids"], dtype=np.int64)
    expanded = tokenizer.decode(ids[0].tolist())
    if tokenizer(expanded, add_special_tokens=False)["input_ids"] != ids[0].tolist():
        raise SystemExit(f"{name}: the decoded prompt does not tokenize back to the ids")
    codes, levels = pack_levels(np.asarray(out["pixel_values_videos"], dtype=np.float32))
    arrays = {
        "input_ids": ids,
        "mm_token_type_ids": np.asarray(out["mm_token_type_ids"], dtype=np.int64),
        "video_grid_thw": np.asarray(out["video_grid_thw"], dtype=np.int64),
        "pixel_codes": codes,
        "pixel_levels": levels,
    }
    if "image_grid_thw" in out:
        image_codes, image_levels = pack_levels(np.asarray(out["pixel_values"], dtype=np.float32))
        arrays.update(image_grid_thw=np.asarray(out["image_grid_thw"], dtype=np.int64))
        arrays.update(image_codes=image_codes, image_levels=image_levels)
    sampled, resized = [], []
    vp = processor.video_processor
    given = case["call"].get("video_metadata") or [{}] * len(case["clips"])
    for spec, grid, metadata, asked in zip(case["clips"], arrays["video_grid_thw"], out["video_metadata"], given):
        # The reference pads a list it was given in place (timestamps); the case's own list is unpadded.
        indices = asked.get("frames_indices") or metadata.frames_indices
        sampled.append([int(i) for i in indices])
        height, width = int(grid[1]) * vp.patch_size, int(grid[2]) * vp.patch_size
        resized.append((height, width) != (spec[1], spec[2]))
    info = {
        "kind": "processor",
        "file": f"{name}.npz",
        "variant": case.get("variant", "default"),
        "load": case.get("load", {}),
        "clips": [list(spec) for spec in case["clips"]],
        "image": list(case["image"]) if "image" in case else None,
        "messages": case["messages"],
        "call": case["call"],
        "ours": case.get("ours"),
        "equivalent_inputs_checked": checked,
        "prompt": prompt,
        "expanded_prompt": collapse_runs(expanded),
        "timestamps": re.findall(r"<(\d+\.\d) seconds>", expanded),
        "frames_indices": sampled,
        "metadata_fps": [metadata.fps for metadata in out["video_metadata"]],
        "resized": resized,
        "warnings": reference_warnings(capture.messages),
        "seq_len": int(ids.shape[1]),
    }
    return arrays, info


RECORDERS = {"processor": record_processor_case}


# --------------------------------------------------------------------------- recording
def record(case_names: Optional[Sequence[str]] = None) -> Tuple[Dict[str, Dict[str, np.ndarray]], dict]:
    torch = _reference.deterministic_torch()
    import tokenizers
    import torchvision
    import transformers

    names = list(CASES) if case_names is None else list(case_names)
    results, cases = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        reference = Reference(pathlib.Path(tmp))
        for name in names:
            case = CASES[name]
            arrays, info = RECORDERS[case.get("kind", "processor")](reference, name, case)
            results[name], cases[name] = arrays, info
    specs = sorted({tuple(spec) for c in CASES.values() for spec in c["clips"]})
    stills = sorted({tuple(c["image"]) for c in CASES.values() if "image" in c})
    index = {
        "format": FORMAT,
        "generated_by": "scripts/reference/video_processor.py",
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        },
        "checkpoint": {"builder": "compass_data.tiny.build_tiny_checkpoint", "layout": "original"},
        "variants": VARIANTS,
        "clips": {"x".join(map(str, s)): clips.clip_sha256(*s) for s in specs},
        "stills": {
            "x".join(map(str, s)): hashlib.sha256(clips.make_clip(1, *s)[0].tobytes()).hexdigest() for s in stills
        },
        "cases": cases,
    }
    return results, index


def save(results: Dict[str, Dict[str, np.ndarray]], index: dict, out_dir: pathlib.Path = OUT_DIR) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.npz"):
        if stale.stem not in results:
            stale.unlink()
    for name, arrays in results.items():
        save_npz(out_dir / f"{name}.npz", arrays)
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT_DIR, help="fixture directory")
    parser.add_argument("cases", nargs="*", help="cases to record (default: all; others are kept)")
    args = parser.parse_args(argv)
    results, index = record(args.cases or None)
    if args.cases and (args.out / "index.json").exists():
        old = json.loads((args.out / "index.json").read_text(encoding="utf-8"))
        index["cases"] = {**old["cases"], **index["cases"]}
        index["cases"] = {name: index["cases"][name] for name in CASES if name in index["cases"]}
        results_to_keep = {p.stem for p in args.out.glob("*.npz")}
        for name in results_to_keep - set(results):
            results[name] = dict(np.load(args.out / f"{name}.npz", allow_pickle=False))
    save(results, index, args.out)
    total = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {len(results)} cases to {args.out} ({total / 2**20:.2f} MiB)")
    for name, case in index["cases"].items():
        grids = results[name]["video_grid_thw"].tolist()
        print(
            f"  {name:42s} L={case['seq_len']:5d} grids={grids} resized={case['resized']} warnings={case['warnings']}"
        )


if __name__ == "__main__":
    main()
