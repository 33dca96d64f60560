"""``python -m compass_compat``: mlx-vlm's generate, server and convert with the patch applied.

Subcommands:

- ``generate``: mlx-vlm's generate flags (``--model --image --prompt --max-tokens
  --temperature --top-p --top-k --seed ...``); without ``--model`` it builds (once) and uses the
  toy default checkpoint (the tiny model trained on synthetic shapes, :mod:`compass_data.toy`),
  without ``--image`` it uses the bundled demo picture (shapes the toy answers correctly). Sampling flags left out are filled in as the installed mlx-vlm's generate does.
  ``--draw-boxes OUT.png`` draws the answer's ``[x1, y1, x2, y2]`` boxes on a copy of the image.
- ``server``: the installed mlx-vlm's own server (its flags), patched, with malformed image
  inputs answered by a 400 (``compass_compat.server_guard``).
- ``convert``: the installed mlx-vlm's converter (its flags, e.g. ``--hf-path ... --mlx-path
  ... -q --q-bits 4``), patched.
- ``run -- CMD ...``: run any command with ``COMPASS_COMPAT_AUTOPATCH=1``, so every Python
  process it starts in this environment is patched by the startup hook (no code change).
- ``info``: which cohere_compass implementation is live, and why; hook and cache status.

Importing this module imports ``compass_compat``, so the patch is in effect before any
subcommand touches mlx-vlm.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from compass_data.toy import (
    HOME_ENV,
    TOY_NOTE,
    default_checkpoint_path,
    default_checkpoint_problem,
    ensure_default_checkpoint,
)

from . import __version__, implementation_info
from .startup import ENV as AUTOPATCH_ENV
from .startup import PTH_NAME, installed_hooks

PROG = "python -m compass_compat"
DEMO_IMAGE = Path(__file__).resolve().parent / "assets" / "demo.png"
DEFAULT_PROMPT = "Describe this picture."
DEFAULT_VIDEO_PROMPT = "Describe this video."
DEFAULT_MAX_TOKENS = 256
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CliError(Exception):
    """A user-facing error: printed as ``<prog> <command>: error: <message>``, exit 2."""


def log(message: str) -> None:
    print(f"[compass-compat] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- checks


def resolve_model(model: Optional[str]) -> Tuple[str, bool]:
    """(path or repo id to load, whether it is the default checkpoint)."""
    if model is None:
        return str(ensure_default_checkpoint(__version__)), True
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CliError(f"{path} has no config.json: it is not a model checkpoint folder")
        if not any(path.glob("*.safetensors")):
            raise CliError(f"{path} has no *.safetensors weights")
        return str(path), False
    if path.exists():
        raise CliError(f"--model {model}: expected a checkpoint folder, got a file")
    if _REPO_ID.match(model) and not model.startswith((".", "~")):
        return model, False  # a Hugging Face repo id: mlx-vlm resolves (downloads) it
    raise CliError(
        f"model folder not found: {path} (pass --model with a checkpoint folder holding "
        "config.json and *.safetensors, or leave --model out for the default tiny checkpoint)"
    )


def check_images(images: Sequence[str]) -> List[str]:
    out = []
    for image in images:
        if image.startswith(("http://", "https://", "data:")):
            out.append(image)
            continue
        path = Path(image).expanduser()
        if not path.is_file():
            raise CliError(f"image file not found: {path}")
        out.append(str(path))
    return out


# ------------------------------------------------------------------------- generate


def check_videos(videos: Sequence[str]) -> List[str]:
    out = []
    for video in videos:
        path = Path(video[len("file://") :] if video.startswith("file://") else video).expanduser()
        if not path.is_file():
            raise CliError(f"video file not found: {path}")
        out.append(str(path))
    return out


def processor_errors(processor) -> Tuple[type, ...]:
    """The processor module's input errors (video and image input it cannot take): reported
    as one-line CLI errors instead of tracebacks."""
    module = sys.modules.get(type(processor).__module__)
    names = ("VideoInputError", "VideoNotSupportedError")
    found = [getattr(module, name, None) for name in names]
    return tuple(e for e in found if isinstance(e, type) and issubclass(e, Exception))


def video_inputs(args: argparse.Namespace, processor, prompt: str, images: Sequence[str], videos: Sequence[str]):
    """(prompt ids and model inputs as stream_generate keywords, per-video frame times) for a
    video prompt, made here on every pin: each file read with the pin's decoder, the frames the
    video processor's ``sample_frames`` picks (the reference's rule), then the processor."""
    import mlx.core as mx
    import numpy as np
    from PIL import Image

    from .video_files import read_video

    video_processor = getattr(processor, "video_processor", None)
    if video_processor is None or not hasattr(video_processor, "sample_frames"):
        raise CliError(
            f"the live cohere_compass processor ({type(processor).__module__}) takes no video; "
            "compass-compat's does: run with COMPASS_COMPAT_FORCE_VENDORED=1"
        )
    sampling = {"fps": args.fps, "max_frames": args.max_frames}
    sampling = {k: v for k, v in sampling.items() if v is not None}
    clips, metadata = [], []
    for video in videos:
        frames, meta = read_video(video, lambda source: video_processor.sample_frames(source, **sampling))
        clips.append(frames)
        metadata.append(
            {"total_num_frames": meta.total_num_frames, "fps": meta.fps, "frames_indices": meta.frames_indices}
        )
    content = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos]
    content.append({"type": "text", "text": prompt})
    messages = [{"role": "user", "content": content}]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(
        text=[text],
        images=[Image.open(i).convert("RGB") for i in images] or None,
        videos=clips,
        video_metadata=metadata,
        do_sample_frames=False,
        **({} if args.cap_pixels_per_frame is None else {"cap_pixels_per_frame": args.cap_pixels_per_frame}),
    )
    kwargs = {"input_ids": mx.array(np.asarray(out["input_ids"]))}
    if out.get("attention_mask") is not None:
        kwargs["mask"] = mx.array(np.asarray(out["attention_mask"]))
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids"):
        if out.get(key) is not None:
            kwargs[key] = mx.array(np.asarray(out[key]))
    times = [[int(i) / (m["fps"] or 24.0) for i in m["frames_indices"]] for m in metadata]
    return text, kwargs, times


def cmd_generate(args: argparse.Namespace) -> int:
    model_ref, is_default = resolve_model(args.model)
    if args.no_image and args.image:
        raise CliError("--no-image and --image exclude each other")
    videos = check_videos(args.video or [])
    if not videos and (args.fps is not None or args.max_frames is not None or args.cap_pixels_per_frame is not None):
        raise CliError("--fps, --max-frames and --cap-pixels-per-frame need --video")
    if args.fps is not None and args.fps <= 0:
        raise CliError(f"--fps must be positive, got {args.fps:g}")
    default_images = [] if videos else [str(DEMO_IMAGE)]
    images = [] if args.no_image else check_images(args.image or default_images)
    box_output = check_box_flags(args, images)
    sampling = given_sampling(args)

    import mlx.core as mx
    from mlx_vlm import load, stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    try:
        model, processor = load(model_ref)
    except Exception as err:  # re-raised as a one-line CliError; the cause stays chained
        where = "" if Path(model_ref).is_dir() else " (no local folder; fetching it from the Hugging Face Hub failed)"
        raise CliError(f"could not load {model_ref}{where}: {type(err).__name__}: {err}") from err
    prompt = " ".join(args.prompt) if args.prompt else (DEFAULT_VIDEO_PROMPT if videos else DEFAULT_PROMPT)
    messages = (
        [{"role": "system", "content": args.system}, {"role": "user", "content": prompt}] if args.system else prompt
    )
    refused = processor_errors(processor)
    from .video_files import VideoDecoderMissingError, VideoFileError

    inputs: Dict[str, object] = {"image": images or None}
    times: List[List[float]] = []
    try:
        if videos:
            formatted, inputs, times = video_inputs(args, processor, prompt, images, videos)
        else:
            formatted = apply_chat_template(processor, model.config, messages, num_images=len(images))
    except (VideoFileError, VideoDecoderMissingError) + refused as err:
        raise CliError(str(err)) from err

    if args.verbose:
        info = implementation_info()
        print("=" * 10)
        print(f"Model: {model_ref}")
        if is_default:
            print(f"       {TOY_NOTE}")
        print(f"cohere_compass: {info.implementation} (mlx-vlm {info.mlx_vlm_version})")
        print(f"Images: {images}")
        if videos:
            for video, at in zip(videos, times):
                shown = ", ".join(f"{t:.2f}" for t in at)
                print(f"Video: {video}: {len(at)} frames at [{shown}] s")
        print(f"Prompt: {prompt}")
        print(f"Sampling: {describe_sampling(sampling_settings(model.config, sampling), args.seed)}")
        print("=" * 10, flush=True)
    elif is_default:
        log("note: " + TOY_NOTE)

    last = None
    pieces = []
    # Seeded here, not before load: building the model draws from the PRNG (weight init).
    mx.random.seed(args.seed)
    # Only the flags given: mlx-vlm fills in the rest as its own generate does on this pin.
    try:
        for result in stream_generate(model, processor, formatted, max_tokens=args.max_tokens, **inputs, **sampling):
            print(result.text, end="", flush=True)
            pieces.append(result.text)
            last = result
    except refused as err:
        raise CliError(str(err)) from err
    print(flush=True)
    if args.verbose and last is not None:
        print("=" * 10)
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens-per-sec")
        print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tokens-per-sec")
        print(f"Peak memory: {last.peak_memory:.3f} GB")
    if box_output is not None:
        lines = draw_answer_boxes("".join(pieces), images, args.box_image_index, box_output)
        if args.verbose:
            print("=" * 10)
            print("\n".join(lines), flush=True)
        else:  # --no-verbose keeps stdout to the text alone
            for line in lines:
                log(line)
    return 0


SAMPLING_FLAGS = ("temperature", "top_p", "top_k")


def _sampling_resolver():
    """mlx-vlm's own resolution of unset sampling options, where it has one (0.7.10; not 0.6.12)."""
    try:
        from mlx_vlm.generate.common import resolve_sampling_defaults
    except ImportError:
        return None
    return resolve_sampling_defaults


def unset_sampling_follows_checkpoint() -> bool:
    """Whether this mlx-vlm's generate fills unset sampling options from generation_config.json."""
    return _sampling_resolver() is not None


def _generate_step_defaults() -> Dict[str, float]:
    """The sampling keywords this mlx-vlm's generate_step takes, with their defaults."""
    generate = importlib.import_module("mlx_vlm.generate")  # a module to 0.4.x, a package from 0.5
    params = inspect.signature(generate.generate_step).parameters
    return {name: params[name].default for name in SAMPLING_FLAGS if name in params}


def given_sampling(args: argparse.Namespace) -> Dict[str, float]:
    """The sampling flags the user passed (as stream_generate keywords); refused where mlx-vlm lacks one."""
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    if given and not unset_sampling_follows_checkpoint():
        # mlx-vlm 0.3.x: no top_k, and generate_step's **kwargs would swallow it silently.
        missing = [name for name in given if name not in _generate_step_defaults()]
        if missing:
            version = implementation_info().mlx_vlm_version
            flags = ", ".join("--" + name.replace("_", "-") for name in missing)
            raise CliError(f"{flags}: mlx-vlm {version}'s generate has no {', '.join(missing)} sampling option")
    return given


def sampling_settings(config, given: Dict[str, float]) -> Dict[str, float]:
    """What stream_generate samples with on this mlx-vlm: ``given``, the rest as mlx-vlm fills them in.

    mlx-vlm 0.7.10 takes unset values from the checkpoint's generation config (load puts
    generation_config.json's keys on the model config), else 0.0 / 1.0 / 0, greedy when
    do_sample is false. mlx-vlm <= 0.6.12 uses generate_step's defaults; 0.6.x load keeps the
    file's keys on the config too, but only its server reads them.
    """
    resolve = _sampling_resolver()
    if resolve is not None:
        return dict(zip(SAMPLING_FLAGS, resolve(config, **{name: given.get(name) for name in SAMPLING_FLAGS})))
    return {name: given.get(name, default) for name, default in _generate_step_defaults().items()}


def describe_sampling(settings: Dict[str, float], seed: int) -> str:
    values = " ".join(f"{name}={value:g}" for name, value in settings.items())
    version = implementation_info().mlx_vlm_version
    if unset_sampling_follows_checkpoint():
        source = f"unset: the checkpoint's generation_config.json, else mlx-vlm {version}'s defaults"
    else:
        source = f"unset: mlx-vlm {version}'s generate defaults, which ignore generation_config.json's sampling keys"
    return f"{values} seed={seed} ({source})"


def check_box_flags(args: argparse.Namespace, images: Sequence[str]) -> Optional[Path]:
    """The --draw-boxes output path, checked before the model loads; None without the flag."""
    if args.draw_boxes is None:
        if args.box_image_index is not None:
            raise CliError("--box-image-index needs --draw-boxes")
        return None
    if not images:
        raise CliError("--draw-boxes needs an image to draw on; drop --no-image")
    index = 0 if args.box_image_index is None else args.box_image_index
    if not 0 <= index < len(images):
        count = f"{len(images)} image" + ("s" if len(images) > 1 else "")
        raise CliError(f"--box-image-index {index}: out of range for {count} (0 is the first)")
    from PIL import Image

    path = Path(args.draw_boxes).expanduser()
    fmt = Image.registered_extensions().get(path.suffix.lower())
    if fmt is None or fmt not in Image.SAVE:
        raise CliError(f"--draw-boxes {args.draw_boxes}: name an image file Pillow can write (.png, .jpg, ...)")
    if path.is_dir():
        raise CliError(f"--draw-boxes {path}: is a folder; name the image file to write")
    if not path.parent.is_dir():
        what = "not a folder" if path.parent.exists() else "folder not found"
        raise CliError(f"--draw-boxes {path}: {what}: {path.parent}")
    if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise CliError(f"--draw-boxes {path}: not writable")
    return path


def draw_answer_boxes(text: str, images: Sequence[str], index: Optional[int], output: Path) -> List[str]:
    """Find the boxes in ``text``, draw them on a copy of image ``index``, write it; the report lines.

    With no box in the text the copy is still written, unannotated (an earlier run's file is
    never left looking like this run's answer), and the report says nothing was found.
    """
    from mlx_vlm.utils import load_image

    from compass_data.boxes import GRID, draw_boxes, format_number, scan_boxes, to_pixels

    explicit, index = index is not None, 0 if index is None else index
    source = images[index]
    try:
        image = load_image(source)  # what the model saw: EXIF orientation applied, RGB
    except Exception as err:
        raise CliError(f"--draw-boxes: cannot read {source}: {err}") from err
    matches = scan_boxes(text)
    boxes = [m.box for m in matches if m.problem is None]
    picture = f"{source} ({image.width}x{image.height}" + (
        f", image {index} of {len(images)})" if len(images) > 1 else ")"
    )
    if boxes:
        lines = [f"Boxes: {len(boxes)} found in the text (0-{GRID} grid) -> pixels of {picture}:"]
    else:
        lines = [f"Boxes: none found in the text (no [x1, y1, x2, y2] list on the 0-{GRID} grid)"]
    for n, box in enumerate(boxes, 1):
        grid = ", ".join(format_number(v) for v in box)
        px = ", ".join(format_number(v) for v in to_pixels(box, image.size))
        lines.append(f"  {n}: [{grid}] -> ({px})")
    for m in matches:
        if m.problem is not None:
            lines.append(f"  ignored [{', '.join(format_number(v) for v in m.values)}]: {m.problem}")
    annotated = draw_boxes(image, boxes, [str(n) for n in range(1, len(boxes) + 1)])
    try:
        annotated.save(output)
    except (OSError, ValueError) as err:
        raise CliError(f"--draw-boxes {output}: could not write it: {err}") from err
    if boxes:
        lines.append(f"Wrote {output}: a copy of the image with the {len(boxes)} boxes, labelled as numbered above")
    else:
        lines.append(f"Wrote {output}: an unannotated copy of {picture}")
    if len(images) > 1 and not explicit:
        lines.append(f"Drew on the first of {len(images)} images; --box-image-index N picks another (0 is the first)")
    return lines


# --------------------------------------------------------------------------- server


def _main_forces_reload(module) -> bool:
    """Whether this mlx-vlm's server ``main()`` always runs uvicorn with ``reload=True`` (0.3.x's
    does): the hook looked for is ``reload=True`` in the source of ``mlx_vlm.server.main``."""
    try:
        return "reload=True" in inspect.getsource(module.main)
    except (OSError, TypeError):  # no source to read: run main() as it is
        return False


def _server_module():
    try:
        return importlib.import_module("mlx_vlm.server")
    except ModuleNotFoundError as err:
        info = implementation_info()
        raise CliError(
            f"mlx-vlm {info.mlx_vlm_version} has no usable server (import mlx_vlm.server failed: {err}); "
            "mlx-vlm's server needs fastapi and uvicorn"
        ) from err


def cmd_server(args: argparse.Namespace, rest: List[str]) -> int:
    model = _flag_value(rest, "--model")
    if model is not None and not args.help:
        resolve_model(model)  # a bad path fails here, with a message, not inside the server
    module = _server_module()
    if args.help:
        _server_parser().print_help()
        print(f"\nEverything else goes to mlx-vlm {implementation_info().mlx_vlm_version}'s server:\n", flush=True)
        rest = ["--help"]
    else:
        # Children spawned by uvicorn --reload re-import the app: the startup hook patches them.
        os.environ[AUTOPATCH_ENV] = "1"
        if not args.no_guard:
            from . import server_guard

            # mlx-vlm declares MAX_IMAGES = 10 per request (every pin to 0.7.10) but never enforces it.
            limit = args.max_images if args.max_images is not None else int(getattr(module, "MAX_IMAGES", 10))
            server_guard.install(module.app, limit)
    if _main_forces_reload(module):
        return _legacy_server(module, rest)
    sys.argv = ["mlx_vlm.server", *rest]
    module.main()
    return 0


def _legacy_server(module, rest: List[str]) -> int:
    # mlx-vlm 0.3.x: main() always runs uvicorn with reload=True, which re-imports the app in
    # a child process (losing the guard) and watches the working directory; serve the app
    # object in this process instead. Its flags are --host and --port; --model preloads.
    parser = argparse.ArgumentParser(prog=f"{PROG} server", description="mlx-vlm 0.3.x server, patched.")
    parser.add_argument("--host", default="0.0.0.0", help="Host for the HTTP server (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8080, help="Port for the HTTP server (default: %(default)s)")
    parser.add_argument("--model", help="Load this model now; requests must name it in their 'model' field.")
    args = parser.parse_args(rest)
    if args.model:
        model_ref, _ = resolve_model(args.model)
        module.get_cached_model(model_ref)
    import uvicorn

    uvicorn.run(module.app, host=args.host, port=args.port, workers=1)
    return 0


# -------------------------------------------------------------------------- convert


def cmd_convert(rest: List[str]) -> int:
    if "-h" in rest or "--help" in rest:
        version = implementation_info().mlx_vlm_version
        print(f"{PROG} convert: mlx-vlm {version}'s converter with the patch applied. Its options:\n", flush=True)
    else:
        hf = _flag_value(rest, "--hf-path")
        if hf is None:
            raise CliError("--hf-path is required (the checkpoint folder to convert)")
        path = Path(hf).expanduser()
        if not path.is_dir() and not _REPO_ID.match(hf):
            raise CliError(f"--hf-path: checkpoint folder not found: {path}")
        if path.is_dir() and not (path / "config.json").is_file():
            raise CliError(f"--hf-path: {path} has no config.json: it is not a model checkpoint folder")
    module = importlib.import_module("mlx_vlm.convert")
    sys.argv = ["mlx_vlm.convert", *rest]
    module.main()
    return 0


def _flag_value(argv: Sequence[str], flag: str) -> Optional[str]:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


# ------------------------------------------------------------------------------ run


def cmd_run(command: List[str]) -> int:
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError(f"run needs a command, e.g. {PROG} run -- python -m mlx_vlm.generate --model PATH ...")
    if not installed_hooks():
        log(
            f"warning: {PTH_NAME} is not installed in this interpreter's site-packages, so "
            f"{AUTOPATCH_ENV}=1 has no effect here; reinstall compass-compat (pip install .)"
        )
    env = dict(os.environ)
    env[AUTOPATCH_ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError as err:
        raise CliError(f"command not found: {command[0]}") from err
    except PermissionError as err:
        raise CliError(f"cannot execute {command[0]}: {err}") from err
    return 0  # not reached: exec replaced this process


# ----------------------------------------------------------------------------- info


def cmd_info(args: argparse.Namespace) -> int:
    info = implementation_info()
    ckpt = default_checkpoint_path()
    problem = default_checkpoint_problem(ckpt)
    hooks = installed_hooks()
    data = dict(vars(info))
    data.update(
        compass_compat_version=__version__,
        startup_hook=[str(h) for h in hooks],
        autopatch_env=os.environ.get(AUTOPATCH_ENV, ""),
        default_checkpoint=str(ckpt),
        default_checkpoint_state="built" if problem is None else problem,
        demo_image=str(DEMO_IMAGE),
    )
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    width = max(len(k) for k in data)
    for key, value in data.items():
        print(f"{key:<{width}}  {value}")
    return 0


# --------------------------------------------------------------------------- parser


def _server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} server",
        add_help=False,
        description=(
            "Start the installed mlx-vlm's own server with the patch applied. Options not listed "
            "here (--model, --host, --port, ...) are mlx-vlm's; they differ between releases. "
            "Malformed image inputs (bad base64, unreadable image, missing file, too many images) "
            "get HTTP 400 instead of mlx-vlm's 500."
        ),
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help and mlx-vlm's server options")
    parser.add_argument(
        "--max-images",
        type=int,
        default=None,
        help="most images per request before a 400 (default: mlx-vlm's MAX_IMAGES, 10)",
    )
    parser.add_argument("--no-guard", action="store_true", help="pass every request to mlx-vlm unchecked")
    return parser


# Measured per pin (tests/test_generation_config.py); releases between 0.6.12 and 0.7.10 unchecked.
_UNSET_SAMPLING = (
    "as the installed mlx-vlm's generate: mlx-vlm 0.7.10 takes the checkpoint's generation_config.json "
    "(greedy if it says do_sample false), else temperature 0, top-p 1, top-k 0; mlx-vlm 0.6.12 and older "
    "use those fixed defaults (0.3.9 has no top-k); --verbose prints the values used"
)


def _bounded(kind, low, high=None):
    """An argparse type: a ``kind`` within [low, high] (NaN refused)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if not (low <= value and (high is None or value <= high)):
            bounds = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="cohere_compass (North-Micro-Vision) on the installed mlx-vlm, with the compass-compat patch applied.",
    )
    parser.add_argument("--version", action="version", version=f"compass-compat {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    gen = sub.add_parser(
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
        "--image",
        nargs="+",
        action="extend",
        metavar="IMAGE",
        help="image file(s) or URL(s); repeatable; default: the bundled demo picture",
    )
    gen.add_argument("--no-image", action="store_true", help="text-only prompt")
    gen.add_argument(
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
    gen.add_argument(
        "--fps",
        type=_bounded(float, 0.0),
        metavar="N",
        help="with --video: frames to sample per second of the clip (default: the processor's, 2)",
    )
    gen.add_argument(
        "--max-frames",
        type=_bounded(int, 1),
        metavar="N",
        help="with --video: sample at most N frames per clip (default: the processor's, 768)",
    )
    gen.add_argument(
        "--cap-pixels-per-frame",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=(
            "with --video: hold each frame to its share of the pixel budget (the reference's capped mode); "
            "--no-cap-pixels-per-frame keeps full-size frames; unset: uncapped with the reference's warning"
        ),
    )
    gen.add_argument("--prompt", nargs="+", help=f"the user message (default: {DEFAULT_PROMPT!r})")
    gen.add_argument("--system", help="system message")
    gen.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="default: %(default)s")
    gen.add_argument(
        "--temperature",
        type=_bounded(float, 0.0),
        metavar="T",
        help=f"sampling temperature, 0 is greedy; default: {_UNSET_SAMPLING}",
    )
    gen.add_argument(
        "--top-p",
        type=_bounded(float, 0.0, 1.0),
        metavar="P",
        help="nucleus sampling, 1 disables it; default: as --temperature",
    )
    gen.add_argument(
        "--top-k",
        type=_bounded(int, 0),
        metavar="K",
        help="sample from the K most likely tokens, 0 disables it; default: as --temperature",
    )
    gen.add_argument(
        "--seed",
        type=int,
        default=0,
        help="PRNG seed for sampling, set just before generating, so a run repeats (default: %(default)s)",
    )
    gen.add_argument(
        "--draw-boxes",
        metavar="OUT.png",
        help=(
            "after generating, find [x1, y1, x2, y2] boxes (0-1000 grid) in the text, draw them on a "
            "copy of the first image and write it to OUT.png (unannotated if none are found)"
        ),
    )
    gen.add_argument(
        "--box-image-index",
        type=int,
        metavar="N",
        help="with --draw-boxes and several images, draw on image N instead (0 is the first)",
    )
    gen.add_argument(
        "--verbose",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="print model, images, prompt and speed around the text (default); --no-verbose prints the text only",
    )

    sub.add_parser(
        "server",
        add_help=False,
        parents=[_server_parser()],
        help="start mlx-vlm's server, patched (mlx-vlm's server flags)",
    )
    sub.add_parser(
        "convert",
        add_help=False,
        help="mlx-vlm's converter, patched (e.g. --hf-path IN --mlx-path OUT -q --q-bits 4)",
    )
    run = sub.add_parser(
        "run",
        help="run a command with the patch applied in its Python processes",
        description=(
            f"Run COMMAND with {AUTOPATCH_ENV}=1: every Python process of this environment it "
            f"starts applies the patch at startup ({PTH_NAME}), without code changes. Example: "
            f"{PROG} run -- python -m mlx_vlm.generate --model PATH --image IMG --prompt TEXT"
        ),
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    info = sub.add_parser("info", help="which cohere_compass implementation is live, and why")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # server and convert hand their remaining flags to mlx-vlm untouched.
    if argv and argv[0] in ("server", "convert"):
        command, rest = argv[0], argv[1:]
        if command == "server":
            args, rest = _server_parser().parse_known_args(rest)
        try:
            return cmd_server(args, rest) if command == "server" else cmd_convert(rest)
        except CliError as err:
            print(f"{PROG} {command}: error: {err}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "run":
            return cmd_run(args.cmd)
        return cmd_info(args)
    except CliError as err:
        print(f"{PROG} {args.command}: error: {err}", file=sys.stderr)
        return 2
