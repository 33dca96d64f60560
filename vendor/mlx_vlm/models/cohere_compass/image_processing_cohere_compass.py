"""Torch-free image processor for cohere_compass, and what the video processor shares with it.

transformers' ``CohereCompassImageProcessorPil`` is the reference (docs/processor.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, NamedTuple, Optional, Sequence

import numpy as np
from PIL import Image, ImageOps
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_utils import BaseImageProcessor
from transformers.image_transforms import (
    normalize,
    rescale,
    resize,
    to_channel_dimension_format,
)
from transformers.image_utils import ChannelDimension, infer_channel_dimension_format

# Published North-Micro-Vision preprocessor_config.json values.
DEFAULT_PATCH_SIZE = 16
DEFAULT_MERGE_SIZE = 2
DEFAULT_TEMPORAL_PATCH_SIZE = 2
DEFAULT_MIN_PIXELS = 65536
DEFAULT_MAX_PIXELS = 16777216
MAX_ASPECT_RATIO = 200

# The settings both processors take, in the video processor's order.
SHARED_KEYS = (
    "size",
    "resample",
    "do_resize",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
)
IMAGE_PROCESSOR_KEYS = (*SHARED_KEYS, "min_pixels", "max_pixels")


# Pixel bounds: two levels (the image processor at load, then each call), each applying `size`,
# then the legacy min_pixels / max_pixels keys; the precedence table: docs/processor.md.
PIXEL_BOUND_KEYS = ("size", "min_pixels", "max_pixels")
_EDGE_OF = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}


class PixelBounds(NamedTuple):
    """Resolved bounds (unvalidated), their sources, the settings file, a bare call's kwargs."""

    min_pixels: Any
    max_pixels: Any
    min_source: str
    max_source: str
    image_config: Any
    image_config_file: Optional[str]
    call_defaults: Dict[str, Any]


def apply_pixel_keys(
    edges: Dict[str, Any],
    values: Dict[str, Any],
    source: str,
    sources: Optional[Dict[str, str]] = None,
) -> Dict[str, Any]:
    """``edges`` after ``values``' `size` (if an object), then its min/max keys (None: absent);
    ``sources`` (edge -> label) updated."""
    edges = dict(edges)
    size = values.get("size") if isinstance(values.get("size"), dict) else {}
    given = [(f"size.{edge}", edge, size.get(edge)) for edge in _EDGE_OF.values()]
    given += [(key, edge, values.get(key)) for key, edge in _EDGE_OF.items()]
    for key, edge, value in given:
        if value is not None:
            edges[edge] = value
            if sources is not None:
                sources[edge] = f"{source} {key}"
    return edges


def settings_file(folder, kind: str = "image") -> tuple:
    """(settings dict, its file) as transformers 5.24 picks it: processor_config.json's
    ``<kind>_processor`` block if the key is there, else the first settings file present."""
    folder = Path(folder)
    block = f"{kind}_processor"
    combined = read_json(folder / "processor_config.json")
    if isinstance(combined, dict) and block in combined:
        return combined[block], f"processor_config.json {block}"
    names = ("video_preprocessor_config.json",) if kind == "video" else ()
    for name in (*names, "preprocessor_config.json"):
        config = read_json(folder / name)
        if config is not None:
            return config, name
    return {}, None


def resolve_pixel_bounds(
    image_config: Any,
    image_config_file: Optional[str] = None,
    tokenizer_config: Optional[dict] = None,
    load_kwargs: Optional[dict] = None,
    call_kwargs: Optional[dict] = None,
) -> PixelBounds:
    """The two levels of pixel bounds, on already-read dicts (see :func:`read_pixel_bounds`)."""

    def given(values: Optional[dict], source: str) -> dict:
        return {
            k: (v, source)
            for k, v in (values or {}).items()
            if k in PIXEL_BOUND_KEYS and v is not None
        }

    file_values = image_config if isinstance(image_config, dict) else {}
    # Level 1: the file, from_pretrained kwargs over it. Level 2: tokenizer_config.json,
    # from_pretrained kwargs (transformers hands them to the tokenizer too), the call.
    level1 = {
        k: (file_values.get(k), image_config_file or "image processor")
        for k in PIXEL_BOUND_KEYS
    }
    level1.update(given(load_kwargs, "from_pretrained"))
    defaults = {
        **given(tokenizer_config, "tokenizer_config.json"),
        **given(load_kwargs, "from_pretrained"),
    }
    sources = {"shortest_edge": "default", "longest_edge": "default"}
    edges = {"shortest_edge": DEFAULT_MIN_PIXELS, "longest_edge": DEFAULT_MAX_PIXELS}
    for level in (level1, {**defaults, **given(call_kwargs, "call")}):
        # Key by key: each edge keeps its own source.
        for key in (k for k in PIXEL_BOUND_KEYS if k in level):
            value, source = level[key]
            edges = apply_pixel_keys(edges, {key: value}, source, sources)
    return PixelBounds(
        edges["shortest_edge"],
        edges["longest_edge"],
        sources["shortest_edge"],
        sources["longest_edge"],
        image_config,
        image_config_file,
        {k: v for k, (v, _) in defaults.items()},
    )


def read_pixel_bounds(
    folder, load_kwargs: Optional[dict] = None, call_kwargs: Optional[dict] = None
) -> PixelBounds:
    """:func:`resolve_pixel_bounds` on a checkpoint folder's three files."""
    folder = Path(folder)
    config, name = settings_file(folder)
    return resolve_pixel_bounds(
        config,
        name,
        read_json(folder / "tokenizer_config.json"),
        load_kwargs,
        call_kwargs,
    )


def smart_resize(
    height: int,
    width: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    frames: int = 1,
    temporal: int = 1,
    what: str = "image",
    error: type = ValueError,
) -> tuple:
    """Target (height, width): multiples of ``factor``, aspect kept, with ``frames`` (rounded to
    ``temporal``) times height times width in [min, max] pixels; Python's half-to-even rounding."""
    if height <= 0 or width <= 0:
        raise error(f"{what} has an empty side: {width}x{height}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise error(
            f"{what} of {width}x{height} pixels has aspect ratio {ratio:.1f}; cohere_compass accepts at most "
            f"{MAX_ASPECT_RATIO}. Crop or pad the {what} first."
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = round(frames / temporal) * temporal
    if t * h * w > max_pixels:
        shrink = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif t * h * w < min_pixels:
        grow = math.sqrt(min_pixels / (frames * height * width))
        h = math.ceil(height * grow / factor) * factor
        w = math.ceil(width * grow / factor) * factor
    return h, w


def positive_int(name: str, value, kind: str = "image") -> int:
    """``value`` as an int, or ValueError naming ``name`` for the ``kind`` ("image", "video") processor."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or value <= 0
    ):
        raise ValueError(
            f"cohere_compass {kind} processor: `{name}` must be a positive integer, got {value!r}"
        )
    return int(value)


def flatten_images(images) -> list:
    """A flat list from one image, a list, a list of lists, or a 4-D array batch."""
    if isinstance(images, np.ndarray) and images.ndim == 4:
        return list(images)
    if not isinstance(images, (list, tuple)):
        return [images]
    flat = []
    for item in images:
        flat.extend(flatten_images(item) if isinstance(item, (list, tuple)) else [item])
    return flat


def _open_file(path) -> Image.Image:
    """The decoded image with EXIF orientation applied, in the file's mode."""
    try:
        with Image.open(path) as im:
            im.load()  # open() is lazy; truncation and decode errors surface here
            return ImageOps.exif_transpose(im)
    except Exception as err:  # OSError, SyntaxError, DecompressionBombError, ...
        raise ValueError(f"cannot read image file {os.fspath(path)!r}: {err}") from err


def _composite_rgb(image: Image.Image) -> Image.Image:
    # Alpha composited onto white, as the reference's convert_to_rgb.
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def _rgb_array(array: np.ndarray, do_convert_rgb: bool) -> np.ndarray:
    """(H, W, 3) array in the input dtype: gray repeated, alpha composited onto white
    (transformers' convert_to_rgb takes arrays only from 5.21)."""
    array = np.asarray(array)
    if array.ndim == 2:  # the reference rejects 2-D arrays; treat them as grayscale
        array = array[..., None]
    if array.ndim != 3:
        raise ValueError(
            f"image array must have 2 or 3 dimensions, got shape {array.shape}"
        )
    layout = infer_channel_dimension_format(array, num_channels=(1, 3, 4))
    array = to_channel_dimension_format(array, ChannelDimension.LAST, layout)
    channels = array.shape[-1]
    if do_convert_rgb and channels == 1:
        array = np.repeat(array, 3, axis=-1)
    elif do_convert_rgb and channels == 4:
        is_int = np.issubdtype(array.dtype, np.integer)
        if not is_int and (array.min() < 0.0 or array.max() > 1.0):
            raise ValueError("a float RGBA image must hold values in [0, 1]")
        white = 255 if is_int else 1.0
        alpha = array[..., 3:4] / white
        blended = alpha * array[..., :3] + (1 - alpha) * white
        array = (np.round(blended) if is_int else blended).astype(array.dtype)
    if array.shape[-1] != 3:
        raise ValueError(
            f"expected an RGB image, got {array.shape[-1]} channel(s) with do_convert_rgb=False"
        )
    return array


def _rgb_image(image, do_convert_rgb: bool) -> Image.Image:
    """A file (as transformers' load_image reads it), a PIL image or a uint8 array, in RGB."""
    if isinstance(image, (str, os.PathLike)):
        if str(image).startswith(("http://", "https://")):
            raise ValueError(
                f"image URLs are not fetched here; load the image first: {image}"
            )
        opened = _open_file(image)
        return opened if opened.mode == "RGB" else opened.convert("RGB")
    if isinstance(image, Image.Image):
        has_alpha = (
            "A" in image.getbands() or image.info.get("transparency") is not None
        )
        if image.mode == "RGB" and not (do_convert_rgb and has_alpha):
            return image
        if not do_convert_rgb:
            raise ValueError(
                f"expected an RGB image, got PIL mode {image.mode!r} with do_convert_rgb=False"
            )
        return _composite_rgb(image) if has_alpha else image.convert("RGB")
    if isinstance(image, np.ndarray):  # uint8: PIL reads it in place
        return Image.fromarray(np.ascontiguousarray(_rgb_array(image, do_convert_rgb)))
    raise ValueError(
        f"unsupported image of type {type(image).__name__}; pass a PIL image, a numpy array or a file path"
    )


def patchify(frames: np.ndarray, patch: int, merge: int, temporal: int) -> tuple:
    """(T, C, H, W) frames, T a multiple of ``temporal`` -> (patch rows in merge-window order, grid [t, h, w])."""
    count, channels, height, width = frames.shape
    grid = [count // temporal, height // patch, width // patch]
    blocks = frames.reshape(
        grid[0],
        temporal,
        channels,
        grid[1] // merge,
        merge,
        patch,
        grid[2] // merge,
        merge,
        patch,
    )
    # -> (t, block row, block col, row in block, col in block, channel, frame, y, x)
    blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return blocks.reshape(
        grid[0] * grid[1] * grid[2], channels * temporal * patch * patch
    ), grid


def batch_feature(data: Dict[str, Any], return_tensors) -> BatchFeature:
    """``data`` as a ``BatchFeature``; ``return_tensors="mlx"`` gives ``mx.array`` on every pin."""
    if (
        return_tensors is None
        or str(getattr(return_tensors, "value", return_tensors)) != "mlx"
    ):
        return BatchFeature(data=data, tensor_type=return_tensors)
    import mlx.core as mx

    arrays = BatchFeature(data=data, tensor_type="np")
    # compass-compat: attention_mask stays numpy (mlx-vlm 0.6.3's server copies it on another thread).
    return BatchFeature(
        data={k: v if k == "attention_mask" else mx.array(v) for k, v in arrays.items()}
    )


class Settings:
    """What both processors share; ``keys`` are the settings a call may override."""

    kind = "image"
    keys: Sequence[str] = IMAGE_PROCESSOR_KEYS

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """From a local checkpoint folder; ``kwargs`` as in ``from_dict``."""
        path = Path(pretrained_model_name_or_path)
        if not path.is_dir():
            raise OSError(
                f"{path} is not a local checkpoint folder (download it first)"
            )
        return cls.from_dict(settings_file(path, cls.kind)[0], **kwargs)

    def _set_shared(self, given: Dict[str, Any]) -> None:
        """Check and set the settings both processors take (``given``: __init__'s locals)."""
        kind, error = self.kind, f"cohere_compass {self.kind} processor:"
        self.size = {
            edge: positive_int(
                f"size.{edge}" + (f" ({key})" if kind == "image" else ""),
                given["size"][edge],
                kind,
            )
            for key, edge in _EDGE_OF.items()
        }
        if self.size["shortest_edge"] > self.size["longest_edge"]:
            raise ValueError(
                f"{error} `size.shortest_edge` ({self.size['shortest_edge']}) exceeds "
                f"`size.longest_edge` ({self.size['longest_edge']})"
            )
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            setattr(self, name, positive_int(name, given[name], kind))
        for name in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            setattr(self, name, bool(given[name]))
        factor = given["rescale_factor"]
        if (
            isinstance(factor, bool)
            or not isinstance(factor, numbers.Real)
            or factor <= 0
        ):
            raise ValueError(
                f"{error} `rescale_factor` must be positive, got {factor!r}"
            )
        self.rescale_factor = float(factor)
        for name in ("image_mean", "image_std"):
            value = given[name]
            values = [value] * 3 if isinstance(value, numbers.Real) else list(value)
            if len(values) != 3 or not all(
                isinstance(v, numbers.Real) and math.isfinite(v) for v in values
            ):
                raise ValueError(
                    f"{error} `{name}` must be 3 finite numbers, got {value!r}"
                )
            setattr(self, name, [float(v) for v in values])
        if 0.0 in self.image_std:
            raise ValueError(f"{error} `image_std` has a zero: {self.image_std}")

    def with_settings(self, overrides: Dict[str, Any]):
        """A copy with ``overrides`` (None values mean "not given"; a `size` updates the edges it names)."""
        overrides = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(overrides) - set(self.keys)
        if unknown:
            raise TypeError(
                f"unexpected {self.kind} processor argument(s): {sorted(unknown)}"
            )
        if not overrides:
            return self
        settings = {
            k: getattr(self, k)
            for k in self.keys
            if k not in ("min_pixels", "max_pixels")
        }
        if "size" in overrides:
            settings["size"] = {**settings["size"], **dict(overrides.pop("size"))}
        return type(self)(**{**settings, **overrides})


class CohereCompassImageProcessor(Settings, BaseImageProcessor):
    """Native-resolution patches for the cohere_compass vision tower.

    Each image becomes ``pixel_values`` rows of ``3 * temporal_patch_size * patch_size**2``
    floats in merge-window order and an ``image_grid_thw`` row ``[1, h/patch, w/patch]``.
    """

    model_input_names = ["pixel_values", "image_grid_thw"]

    def __init__(
        self,
        patch_size: int = DEFAULT_PATCH_SIZE,
        merge_size: int = DEFAULT_MERGE_SIZE,
        temporal_patch_size: int = DEFAULT_TEMPORAL_PATCH_SIZE,
        size: Optional[Dict[str, int]] = None,
        min_pixels: Optional[int] = None,
        max_pixels: Optional[int] = None,
        do_resize: bool = True,
        resample: int = Image.Resampling.BICUBIC,
        do_rescale: bool = True,
        rescale_factor: float = 1 / 255,
        do_normalize: bool = True,
        image_mean: Sequence[float] = (0.5, 0.5, 0.5),
        image_std: Sequence[float] = (0.5, 0.5, 0.5),
        do_convert_rgb: bool = True,
        **kwargs,
    ):
        # Checkpoints may carry spatial_merge_size (the vision config's name) or neither.
        merge_size = kwargs.pop("spatial_merge_size", merge_size)
        super().__init__(**kwargs)
        size = apply_pixel_keys(
            {"shortest_edge": DEFAULT_MIN_PIXELS, "longest_edge": DEFAULT_MAX_PIXELS},
            {
                "size": dict(size) if size is not None else None,
                "min_pixels": min_pixels,
                "max_pixels": max_pixels,
            },
            "image processor",
        )
        self._set_shared(locals())
        if resample not in {int(r) for r in Image.Resampling}:
            raise ValueError(
                f"cohere_compass image processor: `resample` must be a PIL filter id, got {resample!r}"
            )
        self.resample = int(resample)

    # Assignable, as on mlx-vlm's own image processors (hosts set them around a request).
    @property
    def min_pixels(self) -> int:
        return self.size["shortest_edge"]

    @min_pixels.setter
    def min_pixels(self, value: int) -> None:
        self.size = {**self.size, "shortest_edge": positive_int("min_pixels", value)}

    @property
    def max_pixels(self) -> int:
        return self.size["longest_edge"]

    @max_pixels.setter
    def max_pixels(self, value: int) -> None:
        self.size = {**self.size, "longest_edge": positive_int("max_pixels", value)}

    @classmethod
    def from_dict(cls, image_processor_dict: Dict[str, Any], **kwargs):
        # The base classes' from_dict sets kwargs as attributes after __init__, skipping validation.
        return_unused = kwargs.pop("return_unused_kwargs", False)
        # kwargs update the dict, so a file's min_pixels / max_pixels still beat a `size` kwarg.
        config = dict(image_processor_dict)
        overrides = {k: v for k, v in kwargs.items() if k in IMAGE_PROCESSOR_KEYS}
        unused = {k: v for k, v in kwargs.items() if k not in IMAGE_PROCESSOR_KEYS}
        processor = cls(**{**config, **overrides})
        return (processor, unused) if return_unused else processor

    def resized_shape(self, height: int, width: int) -> tuple:
        factor = self.patch_size * self.merge_size
        if not self.do_resize:
            if height % factor or width % factor:
                raise ValueError(
                    f"with do_resize=False the image sides must be multiples of {factor}, got {width}x{height}"
                )
            return height, width
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"cohere_compass image processor: min_pixels ({self.min_pixels}) exceeds max_pixels "
                f"({self.max_pixels}); set them so that min_pixels <= max_pixels"
            )
        return smart_resize(height, width, factor, self.min_pixels, self.max_pixels)

    def get_number_of_image_patches(
        self, height: int, width: int, images_kwargs: Optional[dict] = None
    ) -> int:
        ip = self.with_settings(
            {
                k: v
                for k, v in (images_kwargs or {}).items()
                if k in IMAGE_PROCESSOR_KEYS
            }
        )
        h, w = ip.resized_shape(height, width)
        return (h // ip.patch_size) * (w // ip.patch_size)

    def num_image_tokens(self, height: int, width: int, **overrides) -> int:
        ip = self.with_settings(overrides)
        return ip.get_number_of_image_patches(height, width) // ip.merge_size**2

    def _pixels(self, image) -> np.ndarray:
        """One image as normalized float32 (H, W, 3) at its target size."""
        if isinstance(image, np.ndarray) and image.dtype != np.uint8:
            # The reference's array path: transformers' resize scales [0, 1] floats up for PIL and back.
            array = _rgb_array(image, self.do_convert_rgb)
            target = self.resized_shape(array.shape[0], array.shape[1])
            if self.do_resize:
                array = resize(
                    array,
                    target,
                    self.resample,
                    input_data_format=ChannelDimension.LAST,
                )
        else:
            pil = _rgb_image(image, self.do_convert_rgb)
            target_h, target_w = self.resized_shape(pil.height, pil.width)
            if self.do_resize:
                # Resize in PIL before any float copy: memory stays bounded by the uint8 input.
                pil = pil.resize((target_w, target_h), resample=self.resample)
            array = np.asarray(pil)
        if self.do_rescale:
            array = rescale(array, self.rescale_factor)
        if self.do_normalize:
            array = normalize(
                array,
                self.image_mean,
                self.image_std,
                input_data_format=ChannelDimension.LAST,
            )
        return array.astype(np.float32, copy=False)

    def preprocess(self, images, return_tensors=None, **overrides) -> BatchFeature:
        ip = self.with_settings(overrides)
        rows, grids = [], []
        for image in flatten_images(images):
            pixels = ip._pixels(image).transpose(2, 0, 1)
            # A still image is its own temporal_patch_size frames.
            frames = np.broadcast_to(
                pixels[None], (ip.temporal_patch_size, *pixels.shape)
            )
            patches, grid = patchify(
                frames, ip.patch_size, ip.merge_size, ip.temporal_patch_size
            )
            rows.append(patches)
            grids.append(grid)
        data = {
            "pixel_values": np.concatenate(rows, axis=0),
            "image_grid_thw": np.asarray(grids, dtype=np.int64),
        }
        GRID_MEMO.remember(data["pixel_values"], data["image_grid_thw"])
        return batch_feature(data, return_tensors)

    __call__ = preprocess


class GridMemo:
    """Grids of recent pixel_values by content, for hosts that call ``encode_image`` without."""

    def __init__(self, capacity: int = 32):
        self.capacity = capacity
        self._grids: "OrderedDict[str, np.ndarray]" = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(pixel_values) -> str:
        array = np.ascontiguousarray(np.asarray(pixel_values, dtype=np.float32))
        digest = hashlib.sha1(array.tobytes()).hexdigest()
        return f"{array.shape}:{digest}"

    def remember(self, pixel_values, grid) -> None:
        key = self.key(pixel_values)
        with self._lock:
            self._grids[key] = np.asarray(grid, dtype=np.int64).reshape(-1, 3)
            self._grids.move_to_end(key)
            while len(self._grids) > self.capacity:
                self._grids.popitem(last=False)

    def recall(self, pixel_values) -> Optional[np.ndarray]:
        key = self.key(pixel_values)
        with self._lock:
            return self._grids.get(key)


GRID_MEMO = GridMemo()


def read_json(path: Path) -> Optional[dict]:
    """The JSON object in ``path``, or None when there is no such file."""
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
