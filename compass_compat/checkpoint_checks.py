"""Checks on a cohere_compass checkpoint folder where the libraries that read it are unsafe
(:func:`validate_checkpoint`; the measured table is docs/checkpoint-files.md), and those libraries'
own refusals as one :class:`CheckpointError` line naming the file and the remedy (:func:`refusal`)."""

from __future__ import annotations

import json
import os
import traceback
from importlib.metadata import version
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple

from .vendor import package_dir, within

MODEL_TYPE = "cohere_compass"
INDEX_FILE = "model.safetensors.index.json"
# What mlx-vlm, mlx and the vendored package raise on a broken file (a list where an object belongs: TypeError, AttributeError).
LIBRARY_ERRORS = (ValueError, RuntimeError, OSError, TypeError, AttributeError, KeyError)
WORDS_MAX = 400  # a strict load_weights error lists every parameter: its start says enough
# Keys that set tensor shapes whose reference defaults describe another model (named when absent).
SHAPE_KEYS = {
    "text_config": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
    "vision_config": (
        "depth",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "patch_size",
        "temporal_patch_size",
        "spatial_merge_size",
        "out_hidden_size",
        "num_position_embeddings",
        "deepstack_visual_indexes",
    ),
}
PUBLISHED_IMAGE_SETTINGS = (
    " (published: size.shortest_edge 65536 = min pixels, size.longest_edge 16777216 = max pixels, patch_size 16, "
    "merge_size 2, temporal_patch_size 2; tokenizer_config.json: min_pixels 16384, max_pixels 3868706)"
)


class CheckpointError(ValueError):
    """A checkpoint folder that cohere_compass cannot, or must not, be loaded from.

    Attributes:
        folder: the checkpoint folder.
        file: the file at fault (a name inside the folder), or None.
    """

    def __init__(self, message: str, *, folder: Any = None, file: Optional[str] = None) -> None:
        super().__init__(message)
        self.folder = None if folder is None else Path(folder)
        self.file = file


def validate_checkpoint(path: Any) -> None:
    """Raise CheckpointError for the first thing in a local cohere_compass folder that mlx-vlm would
    read unsafely: a path leaving the folder, a model_file, no rotary parameters, a quantization mode
    this install's loader drops. Reads only the folder's entries and its JSON files."""
    folder = Path(os.fspath(path))
    if not folder.is_dir():
        raise CheckpointError(
            f"{folder} is not a local checkpoint folder; download the checkpoint first", folder=folder
        )
    roots = _allowed_roots(folder)
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            _check_reference(folder, entry.name, roots, what="entry")
    index = _json(folder / INDEX_FILE)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    # mlx-vlm >= 0.6 joins each shard an index names to the folder, "../" and absolute names too.
    for shard in sorted(set(map(str, weight_map.values()))) if isinstance(weight_map, dict) else ():
        _check_reference(folder, shard, roots, what=f"{INDEX_FILE} shard")
    config = _json(folder / "config.json")
    if not isinstance(config, dict):
        return  # mlx-vlm refuses it (refusal)
    _check_model_file(folder, config)
    _check_rope(folder, config)
    _check_quantization(folder, config.get("quantization"))


def _json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------ paths leaving the folder


def _allowed_roots(folder: Path) -> Tuple[str, ...]:
    real = os.path.realpath(folder)
    roots = [real]
    # A Hugging Face cache snapshot (models--org--name/snapshots/<rev>/) is a folder of
    # symlinks into models--org--name/blobs/: those targets belong to the checkpoint.
    for candidate in {folder.absolute(), Path(real)}:
        if candidate.parent.name == "snapshots" and candidate.parent.parent.name.startswith("models--"):
            roots.append(os.path.realpath(candidate.parent.parent / "blobs"))
    return tuple(roots)


def _inside(target: str, roots: Iterable[str]) -> bool:
    return any(os.path.commonpath([target, root]) == root for root in roots)


def _check_reference(folder: Path, name: str, roots: Tuple[str, ...], what: str) -> None:
    """Refuse ``name`` (inside ``folder``) if it, or the link it is, leads out of the folder."""
    if os.path.isabs(name) or ".." in Path(name).parts:
        problem, fix = "points outside the checkpoint folder", "put the file in the folder and name it relative to it"
    else:
        target = os.path.realpath(folder / name)
        if _inside(target, roots):
            return
        problem, fix = f"is a link to {target}, outside the checkpoint folder", "copy the file into the folder"
    raise CheckpointError(
        f"{what} {name!r} in {folder} {problem}; compass-compat reads only files inside it: {fix}",
        folder=folder,
        file=name,
    )


# ------------------------------------------------------------------ config.json


def _check_model_file(folder: Path, config: Dict[str, Any]) -> None:
    if config.get("model_file"):
        # mlx-vlm >= 0.7 imports config.json's model_file from the checkpoint folder in
        # get_model_and_args, with no opt-in (0.3.9 to 0.6.12 ignore the key).
        raise CheckpointError(
            f"config.json in {folder} declares model_file={config['model_file']!r}: mlx-vlm >= 0.7 would "
            "execute that file. compass-compat never runs code from a checkpoint; remove the "
            "model_file key (cohere_compass needs no checkpoint code)",
            folder=folder,
            file="config.json",
        )


def _check_rope(folder: Path, config: Dict[str, Any]) -> None:
    text = config.get("text_config")
    if isinstance(text, dict) and text.get("rope_parameters") is None and text.get("rope_theta") is None:
        # transformers' model raises KeyError without them; the MLX model loads and runs every
        # layer without positional encoding, answering wrong.
        raise CheckpointError(
            f"config.json in {folder}: text_config has no rope_parameters, so sliding layers would get "
            "no rotary embedding (transformers refuses such a config). Copy rope_parameters from the "
            'published config.json, e.g. {"sliding_attention": {"rope_type": "default", '
            '"rope_theta": 50000, "mrope_section": [24, 20, 20], "mrope_interleaved": true}, '
            '"full_attention": null}',
            folder=folder,
            file="config.json",
        )


# Quantization modes beyond affine and the (group_size, bits) each needs; whether this install's
# loader passes the mode is measured by compass_compat.probes (docs/testing.md).
QUANT_MODES = {"mxfp4": (32, 4), "mxfp8": (32, 8), "nvfp4": (16, 4)}


def _check_quantization(folder: Path, block: Any) -> None:
    """Each quantization mode config.json names (the block, its per-module overrides)."""
    if not isinstance(block, dict):
        return
    for values in [block] + [v for v in block.values() if isinstance(v, dict)]:
        mode = values.get("mode", block.get("mode", "affine"))
        bits, group = values.get("bits", block.get("bits")), values.get("group_size", block.get("group_size"))
        _check_mode(folder, mode, bits, group)


def _check_mode(folder: Path, mode: Any, bits: Any, group: Any) -> None:
    """Refuse a quantization mode this install is measured not to load, before mlx-vlm's loader runs."""
    if mode == "affine" or QUANT_MODES.get(mode) != (group, bits):
        return  # mlx refuses an unknown mode, and weights of another group or bits, itself
    mlx_vlm, mlx = version("mlx-vlm"), version("mlx")
    pin = f"mlx-vlm {mlx_vlm} with mlx {mlx}"
    affine = (
        "or use an affine conversion of the model (mlx_vlm.convert -q --q-bits 4 or 8, whose default mode is affine)"
    )
    from . import probes

    loader = probes.loader_passes_mode(mode, group, bits)
    if loader.broken:
        raise CheckpointError(
            f"{folder}: the weights are quantized in mode {mode!r}, which {pin} cannot load: mlx-vlm {mlx_vlm}'s "
            f"loader quantizes the model without the mode, so the {mode} weights do not fit it (measured: "
            f"{loader.evidence}). Load it with an mlx-vlm whose load_model passes quantization['mode'] to "
            f"mlx.nn.quantize, {affine}",
            folder=folder,
            file="config.json",
        )


# ------------------------------------------------------------------ the libraries' refusals


def refusal(folder: Any, err: BaseException) -> Optional[CheckpointError]:
    """``err``, raised by mlx-vlm, mlx or the vendored model or processor while loading the
    cohere_compass folder ``folder``, as one CheckpointError line with the remedy (one template per
    remedy), or None for an error that is not about the folder's files."""
    if isinstance(err, CheckpointError) or not isinstance(err, LIBRARY_ERRORS):
        return None
    folder = Path(os.fspath(folder))
    words = " ".join(str(err).split())
    words = f"{type(err).__name__}: {words[:WORDS_MAX]}{' ...' if len(words) > WORDS_MAX else ''}"
    raised_in = traceback.extract_tb(err.__traceback__)[-1].filename if err.__traceback__ else ""
    config = _json(folder / "config.json")
    hint = _defaulted_hint(config) if isinstance(config, dict) else ""
    if "processing" in Path(raised_in).name and within(raised_in, package_dir()):
        return CheckpointError(
            f"{folder}: {words}. Restore the image settings published with the checkpoint (processor_config.json's "
            f"image_processor block, preprocessor_config.json, tokenizer_config.json){PUBLISHED_IMAGE_SETTINGS}",
            folder=folder,
        )
    if within(raised_in, package_dir()):  # the vendored model refuses a config.json value
        return CheckpointError(
            f"config.json in {folder}: {words}. Fix that value (the published config.json has the right one).{hint}",
            folder=folder,
            file="config.json",
        )
    if isinstance(err, ValueError) and f"{os.sep}mlx{os.sep}nn{os.sep}" in raised_in:
        return CheckpointError(
            f"{folder}: config.json and the weights disagree ({words}). Use the config.json published with "
            f"these weights, or the weights published with it.{hint}",
            folder=folder,
            file="config.json",
        )
    file = _file_read(err, folder)
    subs = [config.get(k) or {} for k in ("text_config", "vision_config")] if isinstance(config, dict) else [None]
    if file is None and not all(isinstance(sub, dict) for sub in subs):
        file = "config.json"  # mlx-vlm reads a sub-config that is not a JSON object as one
    return CheckpointError(
        f"{file or 'the checkpoint'} in {folder} cannot be read ({words}); the download is incomplete or the file "
        "corrupt: download the checkpoint again",
        folder=folder,
        file=file,
    )


def _file_read(err: BaseException, folder: Path) -> Optional[str]:
    """The name of the folder's file a frame of ``err``'s traceback was reading (innermost first)."""
    real = os.path.realpath(folder)
    frames = list(traceback.walk_tb(err.__traceback__))
    for frame, _ in reversed(frames):
        for value in frame.f_locals.values():
            value = getattr(value, "name", value)  # an open file: its path
            if isinstance(value, (str, os.PathLike)):
                path = os.path.realpath(os.fspath(value))
                if os.path.dirname(path) == real and os.path.isfile(path):
                    return os.path.basename(path)
    return None


def _defaulted_hint(config: Dict[str, Any]) -> str:
    subs = {sub: config.get(sub) if isinstance(config.get(sub), dict) else {} for sub in SHAPE_KEYS}
    missing = [f"{sub}.{k}" for sub, keys in SHAPE_KEYS.items() for k in keys if k not in subs[sub]]
    if not missing:
        return ""
    return (
        f" config.json leaves {', '.join(missing)} to the reference's defaults, which describe "
        "another model: add those keys from the published config.json."
    )


__all__ = ["CheckpointError", "refusal", "validate_checkpoint"]
