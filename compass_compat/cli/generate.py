"""``generate``: mlx-vlm's load + stream_generate with the patch applied; without ``--model`` the toy
default checkpoint (built once), without ``--image`` the bundled demo picture."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from compass_data.toy import HOME_ENV, TOY_NOTE

from .. import implementation_info
from . import boxes, video
from .common import CliError, bounded, log
from .inputs import check_adapter, check_images, resolve_model

DEMO_IMAGE = Path(__file__).resolve().parents[1] / "assets" / "demo.png"
DEFAULT_PROMPT = "Describe this picture."
DEFAULT_VIDEO_PROMPT = "Describe this video."
DEFAULT_MAX_TOKENS = 256
RULE = "=" * 10  # frames the verbose output's sections
SAMPLING_FLAGS = ("temperature", "top_p", "top_k")
SHOWN_PROMPT = 200  # characters of a long prompt the header echoes


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """The ``generate`` sub-parser: mlx-vlm's generate flags, --video and --draw-boxes."""
    gen = subparsers.add_parser(
        "generate",
        help="generate text from images and a prompt (mlx-vlm's generate flags)",
        description=(
            "Generate text with mlx-vlm's load + stream_generate, the prompt formatted by "
            "mlx_vlm.prompt_utils.apply_chat_template as mlx-vlm's own CLI does. Without --model "
            "the toy default checkpoint (a tiny model trained on synthetic shapes) is built once under "
            f"${HOME_ENV} (default ~/.cache/compass-compat); without --image the bundled demo "
            "picture is used."
        ),
    )
    gen.add_argument("--model", help="checkpoint folder (or Hugging Face repo id); default: the toy checkpoint")
    gen.add_argument(
        "--adapter-path",
        help=(
            "folder of a LoRA/DoRA adapter trained by mlx-vlm's trainer (adapters.safetensors + "
            "adapter_config.json), applied by mlx-vlm's load; on 0.7.x also a full fine-tune's output"
        ),
    )
    gen.add_argument(
        "--image",
        nargs="+",
        action="extend",
        metavar="IMAGE",
        help="image file(s) or URL(s); repeatable; default: the bundled demo picture",
    )
    gen.add_argument("--no-image", action="store_true", help="text-only prompt")
    video.add_arguments(gen)
    gen.add_argument("--prompt", nargs="+", help=f"the user message (default: {DEFAULT_PROMPT!r})")
    gen.add_argument("--system", help="system message")
    gen.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="default: %(default)s")
    unset = "(default: what the installed mlx-vlm's generate uses)"
    gen.add_argument(
        "--temperature",
        type=bounded(float, 0.0),
        metavar="T",
        help="0 is greedy (default: what the installed mlx-vlm's generate uses; 0.7.x reads generation_config.json)",
    )
    gen.add_argument("--top-p", type=bounded(float, 0.0, 1.0), metavar="P", help=f"nucleus sampling, 1 is off {unset}")
    gen.add_argument("--top-k", type=bounded(int, 0), metavar="K", help=f"the K likeliest tokens, 0 is off {unset}")
    gen.add_argument(
        "--seed",
        type=int,
        default=0,
        help="PRNG seed for sampling, set just before generating, so a run repeats (default: %(default)s)",
    )
    boxes.add_arguments(gen)
    gen.add_argument(
        "--verbose",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="print model, images, prompt and speed around the text (default); --no-verbose prints the text only",
    )


def main(args: argparse.Namespace) -> int:
    """Check every flag and file, load the model, stream the text to stdout; 0 on success."""
    model_ref, is_default = resolve_model(args.model)
    adapter = check_adapter(args.adapter_path)
    if args.no_image and args.image:
        raise CliError("--no-image and --image exclude each other")
    videos = video.checked_videos(args)
    default_images = [] if videos else [str(DEMO_IMAGE)]
    images = [] if args.no_image else check_images(args.image or default_images)
    box_output = boxes.check_box_flags(args, images)
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}

    import mlx.core as mx
    from mlx_vlm import stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    from ..video_files import VideoDecoderMissingError, VideoFileError

    model, processor = _load(model_ref, adapter)
    if args.prompt is not None and not " ".join(args.prompt).strip():
        raise CliError("--prompt is empty: give the question to ask, or leave --prompt out for the default")
    prompt = " ".join(args.prompt) if args.prompt else (DEFAULT_VIDEO_PROMPT if videos else DEFAULT_PROMPT)
    last, pieces = None, []
    try:
        if videos:
            formatted, inputs, times = video.video_inputs(args, processor, prompt, images, videos)
        else:  # formatted as mlx-vlm's own CLI does
            system, user = {"role": "system", "content": args.system}, {"role": "user", "content": prompt}
            messages = [system, user] if args.system else prompt
            formatted = apply_chat_template(processor, model.config, messages, num_images=len(images))
            inputs, times = {"image": images or None}, []
        if args.verbose:
            _print_header(model_ref, adapter, is_default, images, videos, times, prompt)
        elif is_default:
            log("note: " + TOY_NOTE)
        # Seeded here, not before load: building the model draws from the PRNG (weight init).
        mx.random.seed(args.seed)
        # Only the flags given: mlx-vlm fills in the rest as its own generate does on this pin.
        for result in stream_generate(model, processor, formatted, max_tokens=args.max_tokens, **inputs, **given):
            print(result.text, end="", flush=True)
            pieces.append(result.text)
            last = result
    except (VideoFileError, VideoDecoderMissingError) + video.processor_errors(processor) as err:
        raise CliError(str(err)) from err
    print(flush=True)
    if args.verbose and last is not None:
        print(RULE)
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens-per-sec")
        print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tokens-per-sec")
        print(f"Peak memory: {last.peak_memory:.3f} GB")
    if box_output is not None:
        lines = boxes.draw_answer_boxes("".join(pieces), images, args.box_image_index, box_output)
        if args.verbose:
            print(RULE)
            print("\n".join(lines), flush=True)
        else:  # --no-verbose keeps stdout to the text alone
            for line in lines:
                log(line)
    return 0


def _load(model_ref: str, adapter: Optional[str] = None):
    """mlx-vlm's (model, processor) for ``model_ref`` (with ``adapter`` applied by mlx-vlm's own
    ``adapter_path``); a failure becomes a one-line CliError."""
    from mlx_vlm import load

    try:
        # Only when given: the keyword is what mlx-vlm's generate passes, nothing more.
        return load(model_ref, adapter_path=adapter) if adapter else load(model_ref)
    except Exception as err:  # re-raised as a one-line CliError; the cause stays chained
        where = "" if Path(model_ref).is_dir() else " (no local folder; fetching it from the Hugging Face Hub failed)"
        with_adapter = f" with the adapter {adapter}" if adapter else ""
        raise CliError(f"could not load {model_ref}{with_adapter}{where}: {type(err).__name__}: {err}") from err


def _print_header(
    model_ref: str,
    adapter: Optional[str],
    is_default: bool,
    images: Sequence[str],
    videos: Sequence[str],
    times: Sequence[Sequence[float]],
    prompt: str,
) -> None:
    """The verbose lines before the text: model, live implementation, inputs, prompt."""
    info = implementation_info()
    print(RULE)
    print(f"Model: {model_ref}")
    if adapter:
        print(f"Adapter: {adapter}")
    if is_default:
        print(f"       {TOY_NOTE}")
    print(f"cohere_compass: {info.implementation} (mlx-vlm {info.mlx_vlm_version})")
    print(f"Images: {images}")
    for path, at in zip(videos, times):
        shown = ", ".join(f"{t:.2f}" for t in at)
        print(f"Video: {path}: {len(at)} frames at [{shown}] s")
    print(f"Prompt: {_shortened(prompt)}")
    print(RULE, flush=True)


def _shortened(prompt: str) -> str:
    """The prompt as the header echoes it: a long one cut in the middle, its length said."""
    if len(prompt) <= SHOWN_PROMPT:
        return prompt
    half = SHOWN_PROMPT // 2
    return f"{prompt[:half]} [... {len(prompt) - 2 * half:,} characters ...] {prompt[-half:]}"
