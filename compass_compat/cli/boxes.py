"""generate's --draw-boxes: the answer's [x1, y1, x2, y2] boxes drawn on a copy of an image
(finding, scaling and drawing are :mod:`compass_data.boxes`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import List, Optional, Sequence

from .common import CliError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--draw-boxes OUT.png and --box-image-index N."""
    parser.add_argument(
        "--draw-boxes",
        metavar="OUT.png",
        help=(
            "after generating, find [x1, y1, x2, y2] boxes (0-1000 grid) in the text, draw them on a "
            "copy of the first image and write it to OUT.png (unannotated if none are found)"
        ),
    )
    parser.add_argument(
        "--box-image-index",
        type=int,
        metavar="N",
        help="with --draw-boxes and several images, draw on image N instead (0 is the first)",
    )


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
