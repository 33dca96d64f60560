"""Torch-free image processor and processor for cohere_compass (North-Micro-Vision).

Behaviour follows transformers' ``CohereCompassImageProcessorPil`` and
``CohereCompassProcessor`` (5.21+); only numpy and PIL do the image math, and the
module imports on transformers 4.57 and 5.x alike. Importing it registers nothing:
compass_compat registers ``CohereCompassProcessor`` with ``AutoProcessor``.

How the mlx-vlm pins drive a processor (read from their utils.py / prompt_utils.py /
generate code):

- Loading, every pin: ``load_processor`` calls ``AutoProcessor.from_pretrained(path,
  **load_kwargs)`` (0.4.4 adds ``use_fast=True``), then sets ``processor.detokenizer``
  and ``processor.tokenizer.stopping_criteria``. ``load`` swaps in
  ``processor.image_processor`` only when the model package exports ``ImageProcessor``
  (this one must not). ``convert`` calls ``processor.save_pretrained``.
- Prompt: 0.3.9 uses ``processor.apply_chat_template(messages, tokenize=False,
  add_generation_prompt=...)`` only if ``"chat_template" in processor.__dict__``; 0.4.4+
  when ``processor.chat_template`` is not None, else the tokenizer's. 0.6.12+ add
  ``enable_thinking=False`` when the method takes ``**kwargs``.
- Text-only prompts never reach the processor: every pin calls
  ``processor.tokenizer(prompts, add_special_tokens=True, ...)`` itself.
- With images: mlx-vlm's llava path runs when ``image_processor`` is an instance of
  *mlx-vlm's own* ``BaseImageProcessor``; ours derives from transformers' class, so the
  processor is called as ``processor(text=..., images=[PIL...], padding=True,
  return_tensors="mlx", add_special_tokens=True)`` (True on every pin for this model
  type). 0.4.4+ add ``padding_side="left"`` if the signature names it; 0.7.10 also
  forwards ``min_pixels``/``max_pixels``/``resized_height``/``resized_width`` when the
  caller set them and the signature has ``**kwargs``. 0.3.9 retries with
  ``return_tensors="pt"`` after any exception. Every returned key becomes a model
  keyword argument. 0.4.4+ convert images to RGB (alpha dropped) before the call.
- 0.7.10 reads ``image_processor.num_image_tokens(h, w, **overrides)`` for budgets.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import numpy as np
from PIL import Image, ImageOps
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_utils import BaseImageProcessor

logger = logging.getLogger(__name__)

# Published North-Micro-Vision preprocessor_config.json values.
DEFAULT_PATCH_SIZE = 16
DEFAULT_MERGE_SIZE = 2
DEFAULT_TEMPORAL_PATCH_SIZE = 2
DEFAULT_MIN_PIXELS = 65536
DEFAULT_MAX_PIXELS = 16777216
MAX_ASPECT_RATIO = 200

IMAGE_PROCESSOR_KEYS = (
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "size",
    "min_pixels",
    "max_pixels",
    "do_resize",
    "resample",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
)
_TOKENIZER_CALL_KEYS = (
    "truncation",
    "max_length",
    "pad_to_multiple_of",
    "return_attention_mask",
    "return_token_type_ids",
    "return_length",
    "verbose",
)


# ---------------------------------------------------------------- pixel bounds
#
# Which min / max pixel bounds an image is resized within, resolved from a checkpoint folder
# the way transformers 5.24 resolves them (read from its processing_utils.ProcessorMixin,
# image_processing_base.get_image_processor_dict and the cohere_compass image processors,
# and measured on folders of each layout: tests/test_pixel_bounds.py). Two levels, the
# same rule at each: start from the level below, let a `size` object replace its entries,
# then let the legacy `min_pixels` / `max_pixels` keys replace those.
#
#   level                     | where the values come from, highest first
#   --------------------------+----------------------------------------------------------------
#   1. image processor        | from_pretrained kwargs (`size`, `min_pixels`, `max_pixels`);
#      (built once, at load)  | the settings file: processor_config.json's `image_processor`
#                             | block when that key exists (then preprocessor_config.json is
#                             | not read at all), else preprocessor_config.json; defaults.
#                             | Inside one dict `min_pixels`/`max_pixels` beat `size`, so a
#                             | file's min_pixels beats a from_pretrained `size`.
#   2. processor call         | call kwargs; from_pretrained kwargs (transformers hands them to
#      (every __call__)       | the tokenizer too, so they land in its init kwargs); the
#                             | tokenizer_config.json keys `size` / `min_pixels` / `max_pixels`
#                             | (ProcessorMixin._merge_kwargs merges tokenizer init kwargs into
#                             | the image kwargs); then level 1. Again min/max beat `size`, so
#                             | a call `size` loses to tokenizer_config.json's min/max_pixels.
#
# The published CohereLabs folder: preprocessor_config.json 65536 / 16777216 but
# tokenizer_config.json 16384 / 3868706, so 16384 / 3868706 (224x224 -> 49 tokens,
# 4032x3024 -> 3710). An mlx-vlm >= 0.6.13 conversion adds processor_config.json whose
# block says 16384 / 3868706: the same.
# compass-compat: where the reference would differ for no purpose, this does not:
# - a key missing from the winning settings file takes the published value (the reference
#   takes its class defaults: 3136 / 1003520 pixels, patch 14, CLIP mean/std);
# - a None call kwarg means "not given" (the reference fails on it), and a `size` given with
#   one edge keeps the other from the level below (the reference fails unless min/max fill it);
# - the image processor built by CohereCompassProcessor.from_pretrained carries the level-2
#   bounds of a call without kwargs, so `image_processor.num_image_tokens` (mlx-vlm 0.7.10's
#   estimate) and `.min_pixels`/`.max_pixels` say what the processor produces;
# - tokenizer_config.json keys other than these three are not merged into image kwargs.

PIXEL_BOUND_KEYS = ("size", "min_pixels", "max_pixels")
_EDGE_OF = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}


class PixelBounds(NamedTuple):
    """Resolved bounds (unvalidated: the caller checks them) and where each came from.

    ``min_source`` / ``max_source`` read like ``"tokenizer_config.json min_pixels"``;
    ``image_config`` is the winning settings dict (level 1's file), ``image_config_file``
    its name or None; ``call_defaults`` the level-2 kwargs a call without kwargs gets.
    """

    min_pixels: Any
    max_pixels: Any
    min_source: str
    max_source: str
    image_config: Any
    image_config_file: Optional[str]
    call_defaults: Dict[str, Any]


def apply_pixel_keys(
    edges: Dict[str, Any], values: Dict[str, Any], source: str, sources: Optional[Dict[str, str]] = None
) -> Dict[str, Any]:
    """``edges`` ({shortest_edge, longest_edge}) after ``values``' `size`, then min/max keys.

    The one rule of both levels. None values count as absent; a `size` that is not an
    object is left for the caller's validation. ``sources`` (edge -> label) is updated.
    """
    edges = dict(edges)
    labels = [("size", edge, f"{source} size.{edge}") for edge in ("shortest_edge", "longest_edge")]
    labels += [(key, edge, f"{source} {key}") for key, edge in _EDGE_OF.items()]
    for key, edge, label in labels:
        value = values.get(key)
        if key == "size":
            value = value.get(edge) if isinstance(value, dict) else None
        if value is not None:
            edges[edge] = value
            if sources is not None:
                sources[edge] = label
    return edges


def image_processor_settings(processor_config: Any, preprocessor_config: Any) -> tuple:
    """(settings dict, its file) as transformers 5.24 picks them: processor_config.json's
    ``image_processor`` block if the key is there, else preprocessor_config.json."""
    if isinstance(processor_config, dict) and "image_processor" in processor_config:
        return processor_config["image_processor"], "processor_config.json image_processor"
    if preprocessor_config is not None:
        return preprocessor_config, "preprocessor_config.json"
    return {}, None


def resolve_pixel_bounds(
    image_config: Any,
    image_config_file: Optional[str] = None,
    tokenizer_config: Optional[dict] = None,
    load_kwargs: Optional[dict] = None,
    call_kwargs: Optional[dict] = None,
) -> PixelBounds:
    """The two levels above, on already-read dicts (see :func:`read_pixel_bounds`)."""
    load = {k: v for k, v in (load_kwargs or {}).items() if k in PIXEL_BOUND_KEYS and v is not None}
    call = {k: v for k, v in (call_kwargs or {}).items() if k in PIXEL_BOUND_KEYS and v is not None}
    sources = {"shortest_edge": "default", "longest_edge": "default"}
    edges = {"shortest_edge": DEFAULT_MIN_PIXELS, "longest_edge": DEFAULT_MAX_PIXELS}
    # Level 1: the settings file, then from_pretrained kwargs over it (one dict, then one rule).
    file_values = image_config if isinstance(image_config, dict) else {}
    level1 = {
        k: (load.get(k), "from_pretrained") if k in load else (file_values.get(k), image_config_file)
        for k in PIXEL_BOUND_KEYS
    }
    for key in PIXEL_BOUND_KEYS:  # applied key by key so each edge keeps its own source
        value, source = level1[key]
        edges = apply_pixel_keys(edges, {key: value}, source or "image processor", sources)
    # Level 2: tokenizer_config.json, from_pretrained kwargs (the tokenizer's too), the call.
    token_values = {k: v for k, v in (tokenizer_config or {}).items() if k in PIXEL_BOUND_KEYS and v is not None}
    defaults = {k: (v, "tokenizer_config.json") for k, v in token_values.items()}
    defaults.update({k: (v, "from_pretrained") for k, v in load.items()})
    merged = {**defaults, **{k: (v, "call") for k, v in call.items()}}
    for key in PIXEL_BOUND_KEYS:
        if key in merged:
            value, source = merged[key]
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


def read_pixel_bounds(folder, load_kwargs: Optional[dict] = None, call_kwargs: Optional[dict] = None) -> PixelBounds:
    """:func:`resolve_pixel_bounds` on a checkpoint folder's three files."""
    folder = Path(folder)
    config, name = image_processor_settings(
        _read_json(folder / "processor_config.json"), _read_json(folder / "preprocessor_config.json")
    )
    return resolve_pixel_bounds(config, name, _read_json(folder / "tokenizer_config.json"), load_kwargs, call_kwargs)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """Target (height, width): multiples of ``factor``, pixel count in [min, max], aspect kept."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image has an empty side: {width}x{height}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image of {width}x{height} pixels has aspect ratio {ratio:.1f}; cohere_compass accepts "
            f"at most {MAX_ASPECT_RATIO}. Crop or pad the image first."
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * grow / factor) * factor
        w = math.ceil(width * grow / factor) * factor
    return h, w


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"cohere_compass image processor: `{name}` must be a positive integer, got {value!r}")
    return int(value)


def _per_channel(name: str, value) -> List[float]:
    values = [value] * 3 if isinstance(value, numbers.Real) else list(value)
    if len(values) != 3 or not all(isinstance(v, numbers.Real) and math.isfinite(v) for v in values):
        raise ValueError(f"cohere_compass image processor: `{name}` must be 3 finite numbers, got {value!r}")
    return [float(v) for v in values]


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
    """The decoded image with EXIF orientation applied, still in the file's mode."""
    # transformers' load_image then converts to plain RGB (no compositing): see _plain_rgb.
    try:
        with Image.open(path) as im:
            im.load()  # open() is lazy; truncation and decode errors surface here
            return ImageOps.exif_transpose(im)
    except Exception as err:  # PIL raises OSError, SyntaxError, DecompressionBombError, ...
        raise ValueError(f"cannot read image file {os.fspath(path)!r}: {err}") from err


def _plain_rgb(image: Image.Image) -> Image.Image:
    return image.convert("RGB")


def _composite_rgb(image: Image.Image) -> Image.Image:
    # Alpha composited onto white, as the reference's convert_to_rgb.
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


# Images up to this many pixels are converted whole; larger ones band by band.
_BANDED_MIN_PIXELS = 1 << 22
_BAND_ROWS = 256
# PIL runs these filters as two separable passes (horizontal, then vertical).
_TWO_PASS = {
    Image.Resampling.BILINEAR,
    Image.Resampling.BICUBIC,
    Image.Resampling.LANCZOS,
    Image.Resampling.BOX,
    Image.Resampling.HAMMING,
}


def convert_and_resize(
    image: Image.Image, convert, size, resample, band_rows: int = _BAND_ROWS, min_pixels: int = _BANDED_MIN_PIXELS
) -> Image.Image:
    """``convert(image).resize(size, resample)`` without converting a large image whole.

    Converting a huge non-RGB image at full size costs up to four copies of it (RGBA:
    RGBA copy, white backdrop, composite, RGB). PIL resizes in a horizontal pass that
    treats each row alone, then a vertical pass; the conversion is per pixel. So
    converting and horizontally resizing band by band, then running the vertical pass
    on the narrow result, yields the same bytes as the one-shot call while holding only
    ``target width x input height`` RGB pixels (tests/test_processor.py compares them).
    """
    width, height = image.size
    if (
        convert is None
        or size[0] >= width
        or width * height < min_pixels
        or Image.Resampling(resample) not in _TWO_PASS
    ):
        rgb = image if convert is None else convert(image)
        return rgb.resize(size, resample=resample)
    narrow = Image.new("RGB", (size[0], height))
    for top in range(0, height, band_rows):
        band = convert(image.crop((0, top, width, min(height, top + band_rows))))
        narrow.paste(band.resize((size[0], band.height), resample=resample), (0, top))
    return narrow if size[1] == height else narrow.resize(size, resample=resample)


def _channels_last(array: np.ndarray) -> np.ndarray:
    if array.ndim == 2:  # the reference rejects 2-D arrays; treat them as grayscale
        return array[..., None]
    if array.ndim != 3:
        raise ValueError(f"image array must have 2 or 3 dimensions, got shape {array.shape}")
    # Channel axis inferred like transformers: leading axis wins when both could be it.
    if array.shape[0] in (1, 3, 4):
        return np.moveaxis(array, 0, -1)
    if array.shape[-1] in (1, 3, 4):
        return array
    raise ValueError(f"cannot tell the channel axis of an image array of shape {array.shape}")


def _rgb_array(array: np.ndarray, do_convert_rgb: bool) -> np.ndarray:
    """(H, W, 3) array in the input dtype: gray repeated, alpha composited onto white."""
    array = _channels_last(np.asarray(array))
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
        raise ValueError(f"expected an RGB image, got {array.shape[-1]} channel(s) with do_convert_rgb=False")
    return array


def _array_to_rgb_pil(array: np.ndarray, do_convert_rgb: bool):
    """RGB PIL image from an array, plus whether values were scaled up from [0, 1].

    PIL resizes uint8 only; the conversion follows the reference's array path.
    """
    array = _rgb_array(array, do_convert_rgb)
    scaled = False
    if array.dtype != np.uint8:
        if np.allclose(array, array.astype(int)):
            if array.min() < 0 or array.max() > 255:
                raise ValueError(f"image values must lie in [0, 255], got [{array.min()}, {array.max()}]")
        elif array.min() >= 0 and array.max() <= 1:
            # The reference multiplies by 255 through float32 and truncates; so do we.
            array = (array.astype(np.float64) * 255).astype(np.float32)
            scaled = True
        else:
            raise ValueError(f"float image values must lie in [0, 1] or [0, 255], got [{array.min()}, {array.max()}]")
        array = array.astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(array), mode="RGB"), scaled


def _source(image, do_convert_rgb: bool):
    """(PIL image, converter to RGB or None, whether values were scaled up from [0, 1])."""
    if isinstance(image, (str, os.PathLike)):
        if str(image).startswith(("http://", "https://")):
            raise ValueError(f"image URLs are not fetched here; load the image first: {image}")
        opened = _open_file(image)
        return opened, None if opened.mode == "RGB" else _plain_rgb, False
    if isinstance(image, Image.Image):
        has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
        if image.mode == "RGB" and not (do_convert_rgb and has_alpha):
            return image, None, False
        if not do_convert_rgb:
            raise ValueError(f"expected an RGB image, got PIL mode {image.mode!r} with do_convert_rgb=False")
        return image, _composite_rgb if has_alpha else _plain_rgb, False
    if isinstance(image, np.ndarray):
        pil, scaled = _array_to_rgb_pil(image, do_convert_rgb)
        return pil, None, scaled
    raise ValueError(
        f"unsupported image of type {type(image).__name__}; pass a PIL image, a numpy array or a file path"
    )


def _batch(data: Dict[str, Any], return_tensors) -> BatchFeature:
    if return_tensors is None or str(getattr(return_tensors, "value", return_tensors)) != "mlx":
        return BatchFeature(data=data, tensor_type=return_tensors)
    # transformers 5.x answers "mlx" with numpy arrays; give mx.array on every version.
    import mlx.core as mx

    arrays = BatchFeature(data=data, tensor_type="np")
    # compass-compat: attention_mask stays numpy. mlx-vlm 0.6.3's server copies it with
    # mx.array() on the request thread; with mlx >= 0.32's per-thread streams the generation
    # thread cannot evaluate that copy and the server aborts ("no Stream(cpu, 1)").
    return BatchFeature(data={k: v if k == "attention_mask" else mx.array(v) for k, v in arrays.items()})


class CohereCompassImageProcessor(BaseImageProcessor):
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
        # Legacy keys win over `size`, as in the reference (apply_pixel_keys: the one rule).
        size = apply_pixel_keys(
            {"shortest_edge": DEFAULT_MIN_PIXELS, "longest_edge": DEFAULT_MAX_PIXELS},
            {"size": dict(size) if size is not None else None, "min_pixels": min_pixels, "max_pixels": max_pixels},
            "image processor",
        )
        self.size = {
            "shortest_edge": _positive_int("size.shortest_edge (min_pixels)", size["shortest_edge"]),
            "longest_edge": _positive_int("size.longest_edge (max_pixels)", size["longest_edge"]),
        }
        if self.size["shortest_edge"] > self.size["longest_edge"]:
            raise ValueError(
                "cohere_compass image processor: `size.shortest_edge` (min_pixels, "
                f"{self.size['shortest_edge']}) exceeds `size.longest_edge` (max_pixels, "
                f"{self.size['longest_edge']})"
            )
        self.patch_size = _positive_int("patch_size", patch_size)
        self.merge_size = _positive_int("merge_size", merge_size)
        self.temporal_patch_size = _positive_int("temporal_patch_size", temporal_patch_size)
        if resample not in {int(r) for r in Image.Resampling}:
            raise ValueError(f"cohere_compass image processor: `resample` must be a PIL filter id, got {resample!r}")
        self.resample = int(resample)
        if isinstance(rescale_factor, bool) or not isinstance(rescale_factor, numbers.Real) or rescale_factor <= 0:
            raise ValueError(
                f"cohere_compass image processor: `rescale_factor` must be a positive number, got {rescale_factor!r}"
            )
        self.rescale_factor = float(rescale_factor)
        self.image_mean = _per_channel("image_mean", image_mean)
        self.image_std = _per_channel("image_std", image_std)
        if 0.0 in self.image_std:
            raise ValueError(f"cohere_compass image processor: `image_std` has a zero: {self.image_std}")
        self.do_resize = bool(do_resize)
        self.do_rescale = bool(do_rescale)
        self.do_normalize = bool(do_normalize)
        self.do_convert_rgb = bool(do_convert_rgb)

    @property
    def min_pixels(self) -> int:
        return self.size["shortest_edge"]

    @property
    def max_pixels(self) -> int:
        return self.size["longest_edge"]

    @classmethod
    def from_dict(cls, image_processor_dict: Dict[str, Any], **kwargs):
        # The base classes set kwargs as attributes after __init__, skipping validation.
        return_unused = kwargs.pop("return_unused_kwargs", False)
        # As in transformers 5.24: kwargs update the dict, so a file's min_pixels / max_pixels
        # still beat a `size` kwarg (see "pixel bounds" above).
        config = dict(image_processor_dict)
        overrides = {k: v for k, v in kwargs.items() if k in IMAGE_PROCESSOR_KEYS}
        unused = {k: v for k, v in kwargs.items() if k not in IMAGE_PROCESSOR_KEYS}
        processor = cls(**{**config, **overrides})
        return (processor, unused) if return_unused else processor

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """From a local folder (or its settings file), the file picked as transformers 5.24
        picks it on every pin (4.57 would read preprocessor_config.json first); kwargs as in
        :meth:`from_dict`. Bounds of an image processor alone: level 1 of "pixel bounds"."""
        path = Path(pretrained_model_name_or_path)
        if path.is_file():
            config = _read_json(path)
        elif path.is_dir():
            config, _ = image_processor_settings(
                _read_json(path / "processor_config.json"), _read_json(path / "preprocessor_config.json")
            )
        else:
            raise OSError(f"{path} is not a local checkpoint folder (download it first)")
        return cls.from_dict(config, **kwargs)

    def _with_overrides(self, overrides: Dict[str, Any]) -> "CohereCompassImageProcessor":
        overrides = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(overrides) - set(IMAGE_PROCESSOR_KEYS)
        if unknown:
            raise TypeError(f"unexpected image processor argument(s): {sorted(unknown)}")
        if not overrides:
            return self
        config = {k: getattr(self, k) for k in IMAGE_PROCESSOR_KEYS if k not in ("min_pixels", "max_pixels")}
        if "size" in overrides:
            config["size"] = {**config["size"], **overrides.pop("size")}
        return type(self)(**{**config, **overrides})

    def resized_shape(self, height: int, width: int) -> tuple:
        factor = self.patch_size * self.merge_size
        if not self.do_resize:
            if height % factor or width % factor:
                raise ValueError(
                    f"with do_resize=False the image sides must be multiples of {factor}, got {width}x{height}"
                )
            return height, width
        return smart_resize(height, width, factor, self.min_pixels, self.max_pixels)

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: Optional[dict] = None) -> int:
        ip = self._with_overrides({k: v for k, v in (images_kwargs or {}).items() if k in IMAGE_PROCESSOR_KEYS})
        h, w = ip.resized_shape(height, width)
        return (h // ip.patch_size) * (w // ip.patch_size)

    def num_image_tokens(self, height: int, width: int, **overrides) -> int:
        ip = self._with_overrides(overrides)
        return ip.get_number_of_image_patches(height, width) // ip.merge_size**2

    def _pixels(self, image) -> np.ndarray:
        """One image as normalized float32 (H, W, 3) at its target size."""
        scaled = False
        if not self.do_resize and isinstance(image, np.ndarray) and image.dtype != np.uint8:
            array = _rgb_array(image, self.do_convert_rgb)  # no PIL round trip, as in the reference
            self.resized_shape(array.shape[0], array.shape[1])  # sides must already fit
        else:
            pil, convert, scaled = _source(image, self.do_convert_rgb)
            target_h, target_w = self.resized_shape(pil.height, pil.width)
            if self.do_resize:
                # Resize in PIL before any float copy: memory stays bounded by the uint8 input.
                pil = convert_and_resize(pil, convert, (target_w, target_h), self.resample)
            elif convert is not None:
                pil = convert(pil)
            array = np.asarray(pil)
        # float64 product, then float32: the reference's rescale, bit for bit.
        if scaled:
            array = (array.astype(np.float64) * (1 / 255)).astype(np.float32)
        if self.do_rescale:
            array = (array.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            array = array.astype(np.float32, copy=False)
            mean = np.asarray(self.image_mean, dtype=np.float32)
            std = np.asarray(self.image_std, dtype=np.float32)
            array = (array - mean) / std
        return np.asarray(array, dtype=np.float32)

    def _patchify(self, pixels: np.ndarray) -> tuple:
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        height, width, channels = pixels.shape
        grid_h, grid_w = height // p, width // p
        blocks = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, channels)
        # -> (block row, block col, row in block, col in block, channel, y, x)
        blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)
        # A still image is its own temporal_patch_size frames: repeat along a new time axis.
        frames = np.broadcast_to(blocks[:, :, :, :, :, None], blocks.shape[:5] + (t, p, p))
        return frames.reshape(grid_h * grid_w, channels * t * p * p), grid_h, grid_w

    def preprocess(self, images, return_tensors=None, **overrides) -> BatchFeature:
        ip = self._with_overrides(overrides)
        rows, grids = [], []
        for image in flatten_images(images):
            patches, grid_h, grid_w = ip._patchify(ip._pixels(image))
            rows.append(patches)
            grids.append([1, grid_h, grid_w])
        if not rows:
            raise ValueError("no images to process")
        data = {
            "pixel_values": np.concatenate(rows, axis=0),
            "image_grid_thw": np.asarray(grids, dtype=np.int64),
        }
        GRID_MEMO.remember(data["pixel_values"], data["image_grid_thw"])
        return _batch(data, return_tensors)

    def __call__(self, images, return_tensors=None, **overrides) -> BatchFeature:
        return self.preprocess(images, return_tensors=return_tensors, **overrides)


class GridMemo:
    """Patch grids of recently processed pixel_values, looked up by content.

    mlx-vlm 0.4.x-0.6.x fill their vision cache with ``model.encode_image(pixel_values)``
    and pass no grid, which the pixels alone cannot determine; the processor that
    made those pixels remembers it here. Bounded; thread-safe.
    """

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


def _read_json(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _named_templates(template):
    # tokenizer_config.json may hold [{"name": ..., "template": ...}, ...].
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}
    if isinstance(template, dict) and set(template) == {"default"}:
        return template["default"]
    return template


def load_chat_template(path: Path, tokenizer=None):
    """Chat template of a checkpoint folder, newest layout first."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        template = (_read_json(path / name) or {}).get("chat_template")
        if template:
            return _named_templates(template)
    return getattr(tokenizer, "chat_template", None)


# ---------------------------------------------------------------- video: refused
#
# The published template renders a video part as <|VISION_START|><|VIDEO_PAD|><|VISION_END|>,
# but this processor has no video preprocessing (frames, timestamps, video grids). Rendering
# the token and running the model anyway would fail deep in the model or, worse, answer
# without the video; so every way in refuses it first: a ``videos=`` argument, a video part
# in apply_chat_template's messages, and any text holding the token (processor call and the
# tokenizer, which mlx-vlm calls itself for text-only prompts).

VIDEO_TOKEN = "<|VIDEO_PAD|>"


class VideoNotSupportedError(ValueError):
    """Video input reached the cohere_compass processor, which supports images only."""


def video_refusal(what: str) -> VideoNotSupportedError:
    return VideoNotSupportedError(
        f"cohere_compass (compass-compat): video input is not supported: {what}. "
        f"The chat template writes {VIDEO_TOKEN} for a video part of a user message "
        "({'type': 'video'} or a 'video' key). Send the video as still frames instead: one "
        "image part per frame in the message, with the frames passed as images."
    )


def refuse_video_text(text) -> None:
    """Raise :class:`VideoNotSupportedError` if ``text`` (a string or a list of them) holds the token."""
    texts = [text] if isinstance(text, str) else text if isinstance(text, (list, tuple)) else ()
    if any(isinstance(t, str) and VIDEO_TOKEN in t for t in texts):
        raise video_refusal(f"the prompt contains {VIDEO_TOKEN}, the token of a video part in a message")


def _is_image_part(part: dict) -> bool:  # the template's rule for user messages
    return part.get("type") == "image" or "image" in part or "image_url" in part


def _is_video_part(part: dict) -> bool:
    return part.get("type") == "video" or "video" in part


def _user_parts(conversation):
    """(message index, part index, part) of the dict parts of user messages' list content."""
    for i, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        if message.get("role") != "user" or not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict):
                yield i, j, part


def _image_source(part: dict):
    for key in ("image", "image_url", "path", "url"):
        value = part.get(key)
        if isinstance(value, dict):  # OpenAI style: {"image_url": {"url": ...}}
            value = value.get("url")
        if value is not None:
            return value
    return None


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        # transformers 4.57 cannot resolve a tokenizer from an unknown model_type; the
        # tokenizer.json alone is enough.
        if not (path / "tokenizer.json").is_file():
            raise
        logger.warning("AutoTokenizer failed for %s (%s); loading tokenizer.json directly", path, err)
        extra = (_read_json(path / "tokenizer_config.json") or {}).get("extra_special_tokens")
        # transformers 5 saves extra_special_tokens as a list (e.g. mlx-vlm 0.7.10's converter
        # output); 4.57 expects a dict of named tokens: pass the list as additional_special_tokens.
        legacy = {"extra_special_tokens": {}, "additional_special_tokens": extra} if isinstance(extra, list) else {}
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True, **legacy)
    return without_double_bos(tokenizer)


def without_double_bos(tokenizer):
    """Make ``tokenizer`` skip its own BOS when the text already starts with it.

    Every mlx-vlm pin tokenizes text-only chat prompts with ``add_special_tokens=True``
    straight through ``processor.tokenizer``, while the chat template already wrote
    ``{{ bos_token }}``; a Cohere-style BOS post-processor would then give two BOS tokens.
    The instance's class is swapped for a subclass (same state, same name) so every
    caller of this tokenizer gets the fix, not only this processor. The subclass also
    refuses text holding the video token (:func:`refuse_video_text`): mlx-vlm tokenizes
    text-only prompts itself, so this processor's ``__call__`` never sees them.
    """
    base = type(tokenizer)
    if getattr(base, "_compass_no_double_bos", False) or not tokenizer.bos_token:
        return tokenizer

    def adds_bos(self) -> bool:
        if "_compass_adds_bos" not in self.__dict__:
            ids = base.__call__(self, "", add_special_tokens=True)["input_ids"]
            self.__dict__["_compass_adds_bos"] = list(ids[:1]) == [self.bos_token_id]
        return self.__dict__["_compass_adds_bos"]

    def strip(self, text, add_special_tokens):
        bos = self.bos_token
        if not add_special_tokens or not bos or not adds_bos(self):
            return text
        if isinstance(text, str):
            return text[len(bos) :] if text.startswith(bos) else text
        if isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text):
            return [t[len(bos) :] if t.startswith(bos) else t for t in text]
        return text

    def __call__(self, text=None, *args, add_special_tokens=True, **kwargs):
        refuse_video_text(text)
        return base.__call__(
            self, strip(self, text, add_special_tokens), *args, add_special_tokens=add_special_tokens, **kwargs
        )

    def encode(self, text, *args, add_special_tokens=True, **kwargs):
        refuse_video_text(text)
        return base.encode(
            self, strip(self, text, add_special_tokens), *args, add_special_tokens=add_special_tokens, **kwargs
        )

    guarded = type(
        base.__name__,
        (base,),
        {
            "__call__": __call__,
            "encode": encode,
            "_compass_no_double_bos": True,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
        },
    )
    tokenizer.__class__ = guarded
    return tokenizer


_GUARDED_DETOKENIZERS: Dict[type, type] = {}


def skipping_padding_ids(detokenizer, vocab_size: int):
    """``detokenizer`` with an ``add_token`` that ignores ids >= ``vocab_size``, as
    transformers' ``decode`` does; everything else (reset, finalize, text, last_segment,
    tokens, tokenmap, copy(), isinstance checks of mlx-vlm's server) is the object's own.

    The instance's class is swapped for a subclass, as in :func:`without_double_bos`, so
    ``copy()`` (mlx-vlm >= 0.6 servers copy it per request) keeps the guard.
    """
    if detokenizer is None or getattr(detokenizer, "_compass_skips_padding_ids", False):
        return detokenizer
    base = type(detokenizer)
    guarded = _GUARDED_DETOKENIZERS.get(base)
    if guarded is None:

        def add_token(self, token, *args, **kwargs):
            if int(token) >= self._compass_vocab_size:
                return None
            return base.add_token(self, token, *args, **kwargs)

        guarded = _GUARDED_DETOKENIZERS[base] = type(
            base.__name__,
            (base,),
            {
                "add_token": add_token,
                "_compass_skips_padding_ids": True,
                "_compass_original_class": base,
                "__module__": base.__module__,
                "__qualname__": base.__qualname__,
            },
        )
    try:
        detokenizer._compass_vocab_size = int(vocab_size)
        detokenizer.__class__ = guarded
    except (TypeError, AttributeError) as err:  # a C type or __slots__: cannot carry the guard
        logger.warning(
            "cohere_compass: cannot guard %s against ids past the tokenizer (%s); sampling such an id may fail in it",
            base.__name__,
            err,
        )
    return detokenizer


class CohereCompassProcessor:
    """Tokenizer + image processor for cohere_compass; expands each ``<|IMAGE_PAD|>``."""

    image_token = "<|IMAGE_PAD|>"
    video_token = "<|VIDEO_PAD|>"
    vision_start_token = "<|VISION_START|>"
    vision_end_token = "<|VISION_END|>"

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, image_defaults=None, **kwargs):
        if tokenizer is None:
            raise ValueError("CohereCompassProcessor needs a tokenizer")
        # Level 2 of "pixel bounds": image kwargs every call starts from. from_pretrained passes
        # them (read from the folder's files); otherwise the tokenizer's init kwargs hold them,
        # as transformers' ProcessorMixin reads them.
        if image_defaults is None:
            init_kwargs = getattr(tokenizer, "init_kwargs", None) or {}
            image_defaults = {k: init_kwargs[k] for k in PIXEL_BOUND_KEYS if init_kwargs.get(k) is not None}
        self.image_defaults = dict(image_defaults)
        self.image_processor = image_processor if image_processor is not None else CohereCompassImageProcessor()
        self.tokenizer = tokenizer
        # An instance attribute: mlx-vlm 0.3.9 looks for it in __dict__.
        self.chat_template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        self.image_token_id = self._token_id(self.image_token, required=True)
        self.video_token_id = self._token_id(self.video_token)
        self.vision_start_token_id = self._token_id(self.vision_start_token)
        self.vision_end_token_id = self._token_id(self.vision_end_token)
        self._adds_bos = None

    def _token_id(self, token: str, required: bool = False) -> Optional[int]:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            if required:
                raise ValueError(f"the tokenizer has no {token} token")
            return None
        return token_id

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """Build from a local checkpoint folder; loader options (revision, use_fast,
        trust_remote_code, ...) are ignored: nothing here reaches the network or runs
        checkpoint code. Image processor keys in ``kwargs`` override the folder's values."""
        path = Path(pretrained_model_name_or_path)
        if not path.is_dir():
            raise OSError(f"{path} is not a local checkpoint folder (download it first)")
        overrides = {k: kwargs.pop(k) for k in IMAGE_PROCESSOR_KEYS if k in kwargs}
        tokenizer = _load_tokenizer(path)
        bounds = read_pixel_bounds(path, load_kwargs=overrides)
        image_processor = CohereCompassImageProcessor.from_dict(bounds.image_config, **overrides)
        if bounds.call_defaults:  # what a call without kwargs uses, so num_image_tokens agrees
            image_processor = image_processor._with_overrides(bounds.call_defaults)
        chat_template = kwargs.pop("chat_template", None) or load_chat_template(path, tokenizer)
        if getattr(tokenizer, "chat_template", None) is None and chat_template is not None:
            tokenizer.chat_template = chat_template  # for callers that template via the tokenizer
        return cls(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=chat_template,
            image_defaults=bounds.call_defaults,
        )

    def save_pretrained(self, save_directory, **kwargs):
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(str(path))
        self.image_processor.save_pretrained(str(path))
        if isinstance(self.chat_template, str):
            (path / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        return [str(path)]

    @property
    def model_input_names(self) -> List[str]:
        return ["input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"]

    def tokenizer_adds_bos(self) -> bool:
        """Whether ``add_special_tokens=True`` makes the tokenizer prepend its BOS token."""
        if self._adds_bos is None:
            bos_id = self.tokenizer.bos_token_id
            ids = self.tokenizer("", add_special_tokens=True)["input_ids"]
            self._adds_bos = bos_id is not None and list(ids[:1]) == [bos_id]
        return self._adds_bos

    def __call__(
        self,
        images=None,
        text=None,
        videos=None,
        *,
        padding=False,
        padding_side: Optional[str] = None,
        add_special_tokens: bool = True,
        return_tensors=None,
        return_mm_token_type_ids: bool = True,
        **kwargs,
    ) -> BatchFeature:
        if videos is not None:
            raise video_refusal("a `videos=` argument was passed")
        refuse_video_text(text)
        if text is None and images is None:
            raise ValueError("CohereCompassProcessor needs text, images or both")
        image_kwargs = {k: kwargs.pop(k) for k in IMAGE_PROCESSOR_KEYS if k in kwargs}
        # Call kwargs over the tokenizer-level defaults (level 2 of "pixel bounds").
        image_kwargs = {**self.image_defaults, **{k: v for k, v in image_kwargs.items() if v is not None}}
        tokenizer_kwargs = {k: kwargs.pop(k) for k in _TOKENIZER_CALL_KEYS if k in kwargs}
        if kwargs:
            logger.warning("CohereCompassProcessor ignores unsupported argument(s): %s", sorted(kwargs))

        images = flatten_images(images) if images is not None else []
        texts = None
        if text is not None:
            texts = [text] if isinstance(text, str) else list(text)
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("`text` must be a string or a list of strings")
            placeholders = sum(t.count(self.image_token) for t in texts)
            if placeholders != len(images):
                raise ValueError(
                    f"the text has {placeholders} {self.image_token} placeholder(s) but {len(images)} "
                    "image(s) were passed; they must match"
                )

        image_inputs = {}
        if images:
            image_processor = self.image_processor
            image_inputs = dict(image_processor(images, **image_kwargs))
            merge = image_kwargs.get("merge_size") or getattr(image_processor, "merge_size", DEFAULT_MERGE_SIZE)
            counts = [int(np.prod(g)) // merge**2 for g in np.asarray(image_inputs["image_grid_thw"])]
            texts = self._expand(texts, counts) if texts is not None else None

        data = {}
        if texts is not None:
            if add_special_tokens and self.tokenizer_adds_bos():
                # The chat template already wrote the BOS token; let the tokenizer add the only one.
                bos = self.tokenizer.bos_token
                texts = [t[len(bos) :] if t.startswith(bos) else t for t in texts]
            if padding_side is not None:
                tokenizer_kwargs["padding_side"] = padding_side
            tokenizer_kwargs.setdefault("return_token_type_ids", False)
            encoded = self.tokenizer(texts, padding=padding, add_special_tokens=add_special_tokens, **tokenizer_kwargs)
            data.update(encoded)
            type_ids = [self._token_types(row) for row in encoded["input_ids"]]
            if images:
                found = sum(int(np.sum(np.asarray(r) == 1)) for r in type_ids)
                if found != sum(counts):
                    raise ValueError(
                        f"tokenized text holds {found} image tokens, expected {sum(counts)} (was it truncated?)"
                    )
            if return_mm_token_type_ids:
                data["mm_token_type_ids"] = type_ids
        data.update(image_inputs)
        return _batch(data, return_tensors)

    def _expand(self, texts: List[str], counts: List[int]) -> List[str]:
        """Each placeholder, in order across the batch, becomes its image's token count."""
        remaining = iter(counts)
        expanded = []
        for t in texts:
            pieces = t.split(self.image_token)
            out = [pieces[0]]
            for piece in pieces[1:]:
                out.append(self.image_token * next(remaining))
                out.append(piece)
            expanded.append("".join(out))
        return expanded

    def _token_types(self, ids) -> List[int]:
        ids = np.asarray(ids)
        types = np.zeros(ids.shape, dtype=np.int64)
        types[ids == self.image_token_id] = 1
        if self.video_token_id is not None:
            types[ids == self.video_token_id] = 2
        return types.tolist()

    def apply_chat_template(self, conversation, chat_template=None, tokenize: bool = False, **kwargs):
        """Render with this processor's template through the tokenizer. With ``tokenize=True``
        the text goes through this processor, with the images found in the messages.
        A video part (or the video token in the text) raises :class:`VideoNotSupportedError`."""
        template = chat_template if chat_template is not None else self.chat_template
        batch = bool(conversation) and not isinstance(conversation[0], dict)
        for i, j, part in (p for c in (conversation if batch else [conversation]) for p in _user_parts(c)):
            if not _is_image_part(part) and _is_video_part(part):
                raise video_refusal(f"message {i} has a video part (content[{j}])")
        if not tokenize:
            text = self.tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False, **kwargs)
            refuse_video_text(text)  # e.g. the token typed into a text part
            return text
        if batch:
            raise ValueError("tokenize=True takes one conversation (a list of messages), not a batch")
        return_dict = kwargs.pop("return_dict", False)
        return_tensors = kwargs.pop("return_tensors", None)
        text = self.tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False, **kwargs)
        # The parts the template renders as an image: user messages only, as it decides.
        images = [_image_source(part) for _, _, part in _user_parts(conversation) if _is_image_part(part)]
        if None in images:
            raise ValueError("an image part carries no image; render with tokenize=False and call the processor")
        out = self(text=text, images=images or None, add_special_tokens=False, return_tensors=return_tensors)
        return out if return_dict else out["input_ids"]

    # compass-compat: ids past the tokenizer (the published checkpoint has 255035 tokenizer
    # entries but 262144 embedding rows) can be sampled; transformers decodes them to "",
    # while mlx-vlm's BPEStreamingDetokenizer raises IndexError. mlx-vlm's load_processor
    # assigns ``processor.detokenizer``: the setter makes that object skip such ids.
    @property
    def detokenizer(self):
        if "_detokenizer" not in self.__dict__:  # unset, as before the property existed
            raise AttributeError("CohereCompassProcessor has no detokenizer (mlx-vlm's load_processor sets one)")
        return self.__dict__["_detokenizer"]

    @detokenizer.setter
    def detokenizer(self, detokenizer):
        self.__dict__["_detokenizer"] = skipping_padding_ids(detokenizer, len(self.tokenizer))

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(image_processor={type(self.image_processor).__name__}, "
            f"tokenizer={type(self.tokenizer).__name__}, image_token_id={self.image_token_id})"
        )


__all__ = [
    "CohereCompassImageProcessor",
    "CohereCompassProcessor",
    "PixelBounds",
    "VideoNotSupportedError",
    "read_pixel_bounds",
    "resolve_pixel_bounds",
    "smart_resize",
]
