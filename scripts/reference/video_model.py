"""Record what transformers' cohere_compass computes for video prompts, for the model parity tests.

Needs transformers' video processor, so torchvision: run it in the recording environment
(scripts/env/reference.sh), never in the matrix:

    .venvs/reference-video/bin/python scripts/reference/video_model.py

For each case, on the tiny checkpoint (compass_data.tiny, original layout, float32) and on the
default toy checkpoint, the reference's own processor (``AutoProcessor``, frames passed with
``do_sample_frames=False`` and explicit metadata, so the frame rules are the processor fixtures'
business, not these) turns the messages and clips into inputs, and
``CohereCompassForConditionalGeneration`` (float32, eager, CPU) gives: ``input_ids``,
``mm_token_type_ids``, ``pixel_values_videos`` (packed losslessly, ``tests.support.pixels``),
``video_grid_thw``, the image inputs where the case has an image, ``position_ids`` and
``rope_deltas`` from ``get_rope_index``, ``video_features`` and ``video_deepstack_features``,
``prefill_logits`` [L, V], and 32 greedy ids with their logits (no cache, checked against the
reference's own cached decode). Written to tests/fixtures/video_model/<checkpoint>/<case>.safetensors
with an index.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
from typing import Dict, List, Optional, Sequence

import numpy as np

from compass_data import clips, tiny, toy
from tests.support import reference as _reference
from tests.support.pixels import pack_levels, read_all_frames

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "video_model"
N_GREEDY = 32
FORMAT = 1


def _clip(name: str) -> np.ndarray:
    return clips.make_clip(*CLIPS[name])


# name -> (frames, height, width, seed). Sizes the tiny checkpoint's video processor keeps as they
# are (multiples of 32; frames x height x width within its pixel bounds), so the pixel values pack
# losslessly and the model sees exactly the reference's frames.
CLIPS = {
    "clip_4x128": (4, 128, 128, 1),
    "clip_5x128": (5, 128, 128, 2),
    "clip_6x96x160": (6, 96, 160, 3),
}
# name -> (messages, [(clip, fps)], [image]). fps is the metadata's; frames_indices are 0..T-1.
CASES = {
    "video_4f": ([("video",), ("text", "Describe this video.")], [("clip_4x128", 2.0)], []),
    "video_5f_odd": ([("text", "What moves?"), ("video",)], [("clip_5x128", 24.0)], []),
    "video_and_image": (
        [("image",), ("video",), ("text", "Is the picture in the video?")],
        [("clip_4x128", 30.0)],
        ["synth_320x256.png"],
    ),
    "video_two": (
        [("video",), ("video",), ("text", "Compare the two videos.")],
        [("clip_4x128", 2.0), ("clip_6x96x160", 3.0)],
        [],
    ),
}
TOY_CASES = ("video_4f",)
# Whole clips as a video file holds them, sampled by the reference itself (do_sample_frames=True,
# the processor's defaults plus the case's keywords): what a file gives through the CLI and the
# mlx-vlm entry points (tests write the clip losslessly and read it back).
# name -> (messages, clip, source fps, sampling keywords). Recorded on the toy checkpoint.
FILE_CLIPS = {
    "clip_72x128": (72, 128, 128, 7),
    "clip_75x128": (75, 128, 128, 8),
    "demo_clip.avi": "compass_compat/assets/demo_clip.avi",  # the README's example (a committed file)
}
FILE_CASES = {
    "file_24fps": ([("video",), ("text", "What moves in this video?")], "clip_72x128", 24.0, {}),
    # max_frames as the video processor's own setting: the reference ignores it as a call keyword
    # (sample_frames reads self.max_frames), so a per-run cap means a processor built with it.
    "file_24fps_max4": (
        [("video",), ("text", "What moves in this video?")],
        "clip_72x128",
        24.0,
        {"processor": {"max_frames": 4}},
    ),
    "file_30fps_odd": ([("video",), ("text", "Describe this video.")], "clip_75x128", 30.0, {}),
    "file_demo": ([("video",), ("text", "Describe this picture.")], "demo_clip.avi", 4.0, {}),
}


def file_clip_frames(name: str) -> np.ndarray:
    """A file case's whole clip: drawn by compass_data.clips, or every frame of a committed file."""
    spec = FILE_CLIPS[name]
    if not isinstance(spec, str):
        return clips.make_clip(*spec)
    return read_all_frames(ROOT / spec)


def messages(parts) -> List[dict]:
    content = []
    for part in parts:
        content.append({"type": part[0], "text": part[1]} if part[0] == "text" else {"type": part[0]})
    return [{"role": "user", "content": content}]


class Reference:
    def __init__(self, checkpoint: pathlib.Path, what: str):
        from transformers import AutoProcessor

        self.model = _reference.load_model(checkpoint, what)
        self.processor = AutoProcessor.from_pretrained(checkpoint)
        self.config = self.model.config

    def inputs(self, case: str) -> dict:
        from PIL import Image

        if case in FILE_CASES:
            parts, clip, fps, sampling = FILE_CASES[case]
            prompt = self.processor.tokenizer.apply_chat_template(
                messages(parts), tokenize=False, add_generation_prompt=True
            )
            frames = file_clip_frames(clip)
            video_processor, chosen = self.processor.video_processor, []
            original = video_processor.sample_frames

            def spy(*args, **kwargs):  # the indices the reference samples, for the index
                indices = original(*args, **kwargs)
                chosen.append([int(i) for i in indices])
                return indices

            sampling = dict(sampling)
            settings = sampling.pop("processor", {})
            saved = {name: getattr(video_processor, name) for name in settings}
            video_processor.sample_frames = spy
            for name, value in settings.items():
                setattr(video_processor, name, value)
            try:
                out = self.processor(
                    text=[prompt],
                    videos=[frames],
                    video_metadata=[{"fps": fps, "total_num_frames": len(frames)}],
                    do_sample_frames=True,
                    add_special_tokens=False,
                    return_tensors="pt",
                    **sampling,
                )
            finally:
                del video_processor.sample_frames
                for name, value in saved.items():
                    setattr(video_processor, name, value)
            out["prompt"], out["frames_indices"] = prompt, chosen
            return out
        parts, videos, images = CASES[case]
        prompt = self.processor.tokenizer.apply_chat_template(
            messages(parts), tokenize=False, add_generation_prompt=True
        )
        kwargs = {}
        if videos:
            frames = [_clip(name) for name, _ in videos]
            kwargs.update(
                videos=frames,
                video_metadata=[
                    {"fps": fps, "total_num_frames": len(f), "frames_indices": list(range(len(f)))}
                    for f, (_, fps) in zip(frames, videos)
                ],
                do_sample_frames=False,
                cap_pixels_per_frame=False,
            )
        if images:
            kwargs["images"] = [Image.open(ROOT / "tests/fixtures/images" / n).convert("RGB") for n in images]
        out = self.processor(text=[prompt], add_special_tokens=False, return_tensors="pt", **kwargs)
        out["prompt"] = prompt
        return out

    def forward(self, seq, inputs, **kwargs):
        import torch

        self.model.model.rope_deltas = None
        mm = inputs["mm_token_type_ids"]
        pad = seq.shape[1] - mm.shape[1]
        mm = mm if pad == 0 else torch.cat([mm, torch.zeros((1, pad), dtype=mm.dtype)], dim=1)
        extra = {k: inputs[k] for k in ("pixel_values", "image_grid_thw") if k in inputs}
        return self.model(
            input_ids=seq,
            pixel_values_videos=inputs["pixel_values_videos"],
            video_grid_thw=inputs["video_grid_thw"],
            mm_token_type_ids=mm,
            **extra,
            **kwargs,
        )

    def record(self, case: str) -> tuple:
        import torch

        inputs = self.inputs(case)
        ids = inputs["input_ids"]
        arrays: Dict[str, np.ndarray] = {
            "input_ids": ids.numpy().astype(np.int64),
            "mm_token_type_ids": inputs["mm_token_type_ids"].numpy().astype(np.int64),
            "video_grid_thw": inputs["video_grid_thw"].numpy().astype(np.int64),
        }
        codes, levels = pack_levels(inputs["pixel_values_videos"].numpy())
        arrays.update(pixel_values_videos_codes=codes, pixel_values_videos_levels=levels)
        if "pixel_values" in inputs:
            codes, levels = pack_levels(inputs["pixel_values"].numpy())
            arrays.update(
                pixel_values_codes=codes,
                pixel_values_levels=levels,
                image_grid_thw=inputs["image_grid_thw"].numpy().astype(np.int64),
            )
        with torch.no_grad():
            feats = self.model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
            position_ids, rope_deltas = self.model.model.get_rope_index(
                ids,
                mm_token_type_ids=inputs["mm_token_type_ids"],
                image_grid_thw=inputs.get("image_grid_thw"),
                video_grid_thw=inputs["video_grid_thw"],
            )
            arrays.update(
                position_ids=position_ids.numpy().astype(np.int64),
                rope_deltas=rope_deltas.numpy().astype(np.int64).reshape(1, 1),
                video_features=torch.cat(feats.pooler_output).numpy(),
                video_deepstack_features=torch.stack([torch.cat(f) for f in feats.deepstack_features]).numpy(),
            )
            arrays["prefill_logits"] = self.forward(ids, inputs, use_cache=False).logits[0].numpy()

            def forward(seq, **kw):
                return self.forward(seq, inputs, **kw)

            greedy, arrays["greedy_logits"] = _reference.greedy_steps(forward, ids, N_GREEDY)
            arrays["greedy_ids"] = np.asarray(greedy, dtype=np.int64)
            if _reference.cached_greedy(self.model, forward, ids, N_GREEDY) != greedy:
                raise SystemExit(f"{case}: cached and uncached greedy decoding of the reference disagree")
        top2 = np.sort(arrays["greedy_logits"], axis=-1)[:, -2:]
        if case in FILE_CASES:
            parts, clip, fps, sampling = FILE_CASES[case]
            spec = FILE_CLIPS[clip]
            videos = [{"clip": clip, "fps": fps, "sampling": sampling}]
            videos[0].update({"file": spec} if isinstance(spec, str) else {"shape": list(spec)})
            videos[0]["frames_indices"] = inputs["frames_indices"][0]
            images = []
        else:
            parts, pairs, images = CASES[case]
            videos = [{"clip": name, "shape": list(CLIPS[name]), "fps": fps} for name, fps in pairs]
        meta = {
            "file": f"{case}.safetensors",
            "messages": messages(parts),
            "videos": videos,
            "images": images,
            "prompt": inputs["prompt"],
            "expanded_prompt": self.processor.tokenizer.decode(ids[0]),
            "seq_len": int(ids.shape[1]),
            "greedy_ids": greedy,
            "greedy_text": self.processor.tokenizer.decode(greedy),
            "greedy_min_margin": round(float((top2[:, 1] - top2[:, 0]).min()), 4),
        }
        return arrays, meta


def record_checkpoint(checkpoint: pathlib.Path, what: str, cases: Sequence[str], out: pathlib.Path) -> dict:
    from safetensors.numpy import save_file

    ref = Reference(checkpoint, what)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    index = {}
    for case in cases:
        arrays, meta = ref.record(case)
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, out / meta["file"])
        index[case] = meta
        print(
            f"  {what} {case:16s} L={meta['seq_len']:4d} margin={meta['greedy_min_margin']:.4f} {meta['greedy_ids'][:8]}"
        )
    return index


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args(argv)
    _reference.deterministic_torch()
    import torch
    import transformers

    index = {
        "format": FORMAT,
        "generated_by": "scripts/reference/video_model.py",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "n_greedy": N_GREEDY,
        "clips": {
            name: spec if isinstance(spec, str) else list(spec) for name, spec in {**CLIPS, **FILE_CLIPS}.items()
        },
        "checkpoints": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny.build_tiny_checkpoint(pathlib.Path(tmp) / "tiny", layout="original", dtype="float32")
        index["checkpoints"]["tiny"] = record_checkpoint(folder, "tiny", list(CASES), args.out / "tiny")
        folder = toy.build_toy_checkpoint(pathlib.Path(tmp) / "toy", layout="original", dtype="float32")
        index["checkpoints"]["toy"] = record_checkpoint(folder, "toy", TOY_CASES + tuple(FILE_CASES), args.out / "toy")
    (args.out / "index.json").write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
