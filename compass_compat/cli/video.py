"""generate's --video: its flags, their checks, and the model inputs made from video files."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Dict, List, Sequence, Tuple

from .common import CliError, bounded, log
from .inputs import check_videos


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--video and the frame sampling flags that go with it."""
    parser.add_argument(
        "--video",
        nargs="+",
        action="extend",
        metavar="VIDEO",
        help=(
            "video file(s) (read with OpenCV, as mlx-vlm reads them); frames are sampled as the "
            "reference does (2 per second of the clip by default, 4 to 768); with --video the demo "
            "picture is not added"
        ),
    )
    parser.add_argument(
        "--fps",
        type=bounded(float, 0.0),
        metavar="N",
        help="with --video: frames to sample per second of the clip (default: the processor's, 2)",
    )
    parser.add_argument(
        "--max-frames",
        type=bounded(int, 1),
        metavar="N",
        help="with --video: sample at most N frames per clip (default: the processor's, 768)",
    )
    parser.add_argument(
        "--cap-pixels-per-frame",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=(
            "with --video: hold each frame to its share of the pixel budget (the reference's capped mode); "
            "--no-cap-pixels-per-frame keeps full-size frames; unset: uncapped with the reference's warning"
        ),
    )


def checked_videos(args: argparse.Namespace) -> List[str]:
    """The --video files, checked to exist, and the frame flags checked against them."""
    videos = check_videos(args.video or [])
    if not videos and (args.fps is not None or args.max_frames is not None or args.cap_pixels_per_frame is not None):
        raise CliError("--fps, --max-frames and --cap-pixels-per-frame need --video")
    if args.fps is not None and args.fps <= 0:
        raise CliError(f"--fps must be positive, got {args.fps:g}")
    return videos


def processor_errors(processor) -> Tuple[type, ...]:
    """The live processor module's VideoInputError (the vendored one has it), reported as a
    one-line CLI error instead of a traceback."""
    error = getattr(sys.modules.get(type(processor).__module__), "VideoInputError", None)
    return (error,) if isinstance(error, type) and issubclass(error, Exception) else ()


def video_inputs(
    args: argparse.Namespace, processor, prompt: str, images: Sequence[str], videos: Sequence[str]
) -> Tuple[str, Dict[str, object], List[List[float]]]:
    """(prompt text, model inputs as stream_generate keywords, per-video frame times) for a
    video prompt, made here on every pin: each file read with the pin's decoder, the frames the
    video processor's ``sample_frames`` picks (the reference's rule), then the processor."""
    import mlx.core as mx
    import numpy as np
    from PIL import Image

    from ..video_files import read_video

    video_processor = getattr(processor, "video_processor", None)
    if video_processor is None or not hasattr(video_processor, "sample_frames"):
        raise CliError(
            f"the live cohere_compass processor ({type(processor).__module__}) takes no video; "
            "compass-compat's does: run with COMPASS_COMPAT_IMPLEMENTATION=vendored (the default where the recorded verdicts say so)"
        )
    sampling = {"fps": args.fps, "max_frames": args.max_frames}
    sampling = {k: v for k, v in sampling.items() if v is not None}
    clips, metadata = [], []
    for video in videos:
        frames, meta = read_video(video, lambda source: video_processor.sample_frames(source, **sampling))
        clips.append(frames)
        metadata.append(meta)
    content = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos]
    content.append({"type": "text", "text": prompt})
    messages = [{"role": "user", "content": content}]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = processor(
            text=[text],
            images=[Image.open(i).convert("RGB") for i in images] or None,
            videos=clips,
            video_metadata=metadata,
            do_sample_frames=False,
            **({} if args.cap_pixels_per_frame is None else {"cap_pixels_per_frame": args.cap_pixels_per_frame}),
        )
    for warning in caught:  # the processor's words name its Python keywords; here they are flags
        said = str(warning.message).replace("`cap_pixels_per_frame=True`", "--cap-pixels-per-frame")
        log("warning: " + said.replace("or `False` to keep", "or --no-cap-pixels-per-frame to keep"))
    kwargs = {"input_ids": mx.array(np.asarray(out["input_ids"]))}
    if out.get("attention_mask") is not None:
        kwargs["mask"] = mx.array(np.asarray(out["attention_mask"]))
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids"):
        if out.get(key) is not None:
            kwargs[key] = mx.array(np.asarray(out[key]))
    times = [[int(i) / (m.fps or 24.0) for i in m.frames_indices] for m in metadata]
    return text, kwargs, times
