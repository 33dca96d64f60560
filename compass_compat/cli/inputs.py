"""Input checks run before anything loads: the model to use, image and video files."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from compass_data.toy import ensure_default_checkpoint

from .. import __version__
from .common import CliError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as on the Hugging Face Hub


def resolve_model(model: Optional[str]) -> Tuple[str, bool]:
    """(path or repo id to load, whether it is the default checkpoint); None means the default,
    built on first use."""
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
    if REPO_ID.match(model) and not model.startswith((".", "~")):
        return model, False  # a Hugging Face repo id: mlx-vlm resolves (downloads) it
    raise CliError(
        f"model folder not found: {path} (pass --model with a checkpoint folder holding "
        "config.json and *.safetensors, or leave --model out for the default tiny checkpoint)"
    )


def check_adapter(adapter: Optional[str]) -> Optional[str]:
    """The ``--adapter-path`` folder checked to hold trained weights (None when not given); what
    else it needs (adapter_config.json) mlx-vlm's load says."""
    if adapter is None:
        return None
    path = Path(adapter).expanduser()
    if not path.exists():
        raise CliError(f"adapter folder not found: {path} (pass the --output-path folder of mlx-vlm's trainer)")
    if path.is_dir() and not any(path.glob("*.safetensors")):
        raise CliError(f"{path} has no *.safetensors: not an adapter folder written by mlx-vlm's trainer")
    return str(path)


def _local_file(path: Path, kind: str) -> None:
    if path.is_dir():
        raise CliError(f"{path} is a folder, not {kind} file: pass the file itself")
    if not path.is_file():
        raise CliError(f"{kind} file not found: {path}")


def check_images(images: Sequence[str]) -> List[str]:
    """The image arguments with local files checked to exist and to be pictures Pillow reads
    (URLs and data URIs pass as given)."""
    from PIL import Image, UnidentifiedImageError

    out = []
    for image in images:
        if image.startswith(("http://", "https://", "data:")):
            out.append(image)
            continue
        path = Path(image).expanduser()
        _local_file(path, "an image")
        try:
            with Image.open(path) as picture:
                picture.verify()
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
            raise CliError(
                f"{path} is not an image Pillow can read ({err}); pass a PNG, JPEG, WebP, ... file"
            ) from None
        out.append(str(path))
    return out


def check_videos(videos: Sequence[str]) -> List[str]:
    """The video files as paths (a ``file://`` prefix dropped), each checked to exist."""
    out = []
    for video in videos:
        path = Path(video[len("file://") :] if video.startswith("file://") else video).expanduser()
        _local_file(path, "a video")
        out.append(str(path))
    return out
