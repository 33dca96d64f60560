"""Checks on a cohere_compass checkpoint folder that mlx-vlm's own loader does not make.

:func:`validate_checkpoint` reads only small files (JSON configs, safetensors headers) and raises
:class:`CheckpointError` saying what is wrong and what to do; what it refuses, and what mlx-vlm's
loader would read first on each pin, is in docs/checkpoint-files.md. The shim's loader guard runs
it on every load (:mod:`compass_compat.load_checks`: one check per ``mlx_vlm.load``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from compass_data.weight_tree import weight_tree

from .vendor import vendored_module

MODEL_TYPE = "cohere_compass"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
MAX_HEADER_BYTES = 100 * 1024 * 1024
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
_DTYPE_BYTES = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0"), 1),
    **dict.fromkeys(("U16", "I16", "F16", "BF16"), 2),
    **dict.fromkeys(("U32", "I32", "F32"), 4),
    **dict.fromkeys(("U64", "I64", "F64", "C64"), 8),
}
PUBLISHED_IMAGE_SETTINGS = (
    " (published: size.shortest_edge 65536 = min pixels, size.longest_edge 16777216 = max pixels, patch_size 16, "
    "merge_size 2, temporal_patch_size 2; tokenizer_config.json: min_pixels 16384, max_pixels 3868706)"
)
_PREPROCESSOR_INTS = (
    "patch_size",
    "merge_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "min_pixels",
    "max_pixels",
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


# One template per kind of remedy; the refusals that need their own fix write it out.
def _restore(folder: Path, label: str, problem: str, published: str = "") -> CheckpointError:
    """A damaged file (``label``: the file, or the file and its block): restore it."""
    message = f"{label} in {folder}{problem}; restore it from the published checkpoint{published}"
    return CheckpointError(message, folder=folder, file=label.split()[0])


def _download(folder: Path, label: str, problem: str, cause: str, file: Optional[str] = None) -> CheckpointError:
    """An incomplete or interrupted download: download it again."""
    message = f"{label} in {folder} {problem}; {cause}: download it again"
    return CheckpointError(message, folder=folder, file=file or label)


def _mismatch(folder: Path, problem: str, config: Dict[str, Any], file: Optional[str] = None) -> CheckpointError:
    """config.json and the weights disagree: use the pair published together."""
    remedy = "Use the config.json published with these weights, or the weights published with it."
    message = f"{folder}: {problem}. {remedy}" + _defaulted_hint(config)
    return CheckpointError(message, folder=folder, file=file)


def _config_fix(folder: Path, problem: str, fix: str = "") -> CheckpointError:
    """config.json says otherwise than the weights: fix it, or restore the published one."""
    remedy = f"{fix}restore the config.json published with these weights"
    return CheckpointError(f"{folder}: {problem}. {remedy[0].upper()}{remedy[1:]}", folder=folder, file="config.json")


def _outside(folder: Path, what: str, name: str, problem: str, fix: str) -> CheckpointError:
    """A path that leaves the folder: compass-compat reads only inside it."""
    message = f"{what} {name!r} in {folder} {problem}; compass-compat reads only files inside it: {fix}"
    return CheckpointError(message, folder=folder, file=name)


@dataclass(frozen=True)
class CheckpointReport:
    """What :func:`validate_checkpoint` looked at.

    Attributes:
        folder: the checkpoint folder.
        weight_files: safetensors files the loaders read (names inside the folder).
        ignored_files: pickle weight files, never opened.
        quantization: the ``quantization`` block of config.json, or None.
        notes: things that are fine but worth knowing (e.g. an ignored ``auto_map``).
    """

    folder: Path
    weight_files: Tuple[str, ...]
    ignored_files: Tuple[str, ...]
    quantization: Optional[Dict[str, Any]]
    notes: Tuple[str, ...]


def validate_checkpoint(path: Any, *, require_weights: bool = True) -> CheckpointReport:
    """Check a local cohere_compass checkpoint folder before loading it.

    Every call checks the folder as it is now. (The shim's loader guard and processor hook
    share one check per load instead: :mod:`compass_compat.load_checks`.)

    Args:
        path: the checkpoint folder.
        require_weights: when False, a folder without weight files (a processor-only
            folder) passes the weight checks; weight files that are present are checked.

    Raises:
        CheckpointError: the first problem found, with what to do about it.
    """
    folder = Path(os.fspath(path))
    return weights_required(check_folder(folder), require_weights)


def check_folder(folder: Path) -> CheckpointReport:
    """Every check, with weights optional (``require_weights=False``); the checks stop at the
    same point either way, so a folder without weights is the only difference (weights_required)."""
    if not folder.is_dir():
        raise CheckpointError(
            f"{folder} is not a local checkpoint folder; download the checkpoint first", folder=folder
        )
    roots = _allowed_roots(folder)
    _check_entries(folder, roots)
    notes: List[str] = []

    config = _read_json(folder, "config.json", required=True)
    _check_model_type(folder, config)
    notes.extend(_check_code_keys(folder, config))
    model_config = _model_config(folder, config)
    _check_image_settings(folder)

    weight_files, ignored = _weight_files(folder, roots)
    if not weight_files and ignored:
        raise CheckpointError(
            f"{folder} holds only pickle weights ({', '.join(ignored)}); compass-compat reads "
            "safetensors only and never unpickles: convert them to safetensors with a tool you "
            "trust, in a separate process, and load the converted folder",
            folder=folder,
            file=ignored[0],
        )
    if weight_files:
        _check_sub_configs(folder, config)
        headers = {name: _read_header(folder, name) for name in weight_files}
        _check_tensors(folder, config, model_config, headers)
    if ignored:
        notes.append(f"pickle files ignored, never opened: {', '.join(ignored)}")
    return CheckpointReport(folder, tuple(weight_files), tuple(ignored), config.get("quantization"), tuple(notes))


def weights_required(report: CheckpointReport, require_weights: bool) -> CheckpointReport:
    if require_weights and not report.weight_files:
        raise CheckpointError(
            f"{report.folder} has no *.safetensors weights; the download is incomplete or this is not a model folder",
            folder=report.folder,
        )
    return report


# ------------------------------------------------------------------ the folder


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


def _check_entries(folder: Path, roots: Tuple[str, ...]) -> None:
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            _check_reference(folder, entry.name, roots, what="entry")


def _check_reference(folder: Path, name: str, roots: Tuple[str, ...], what: str) -> Path:
    """Resolve ``name`` inside ``folder``; refuse anything that leaves it."""
    if os.path.isabs(name) or ".." in Path(name).parts:
        fix = "put the file in the folder and name it relative to it"
        raise _outside(folder, what, name, "points outside the checkpoint folder", fix)
    path = folder / name
    target = os.path.realpath(path)
    if not _inside(target, roots):
        raise _outside(
            folder, what, name, f"is a link to {target}, outside the checkpoint folder", "copy the file into the folder"
        )
    if path.is_symlink() and not os.path.exists(target):
        raise _download(
            folder, f"{what} {name!r}", f"is a broken link (to {target})", "the download is incomplete", name
        )
    return path


def _read_json(folder: Path, name: str, *, required: bool) -> Optional[Dict[str, Any]]:
    path = folder / name
    if not path.is_file():
        if required:
            raise CheckpointError(
                f"{folder} has no {name}; a checkpoint folder needs the {name} published with "
                "its weights (re-download the checkpoint)",
                folder=folder,
                file=name,
            )
        return None

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise _restore(
            folder, name, f" is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})"
        ) from err
    except UnicodeDecodeError as err:
        raise _restore(folder, name, f" is not UTF-8 text ({err})") from err
    if not isinstance(data, dict):
        raise _restore(folder, name, f" must hold a JSON object, not {type(data).__name__}")
    return data


# ------------------------------------------------------------------ config.json


def _check_model_type(folder: Path, config: Dict[str, Any]) -> None:
    model_type = config.get("model_type")
    if model_type != MODEL_TYPE:
        raise CheckpointError(
            f"config.json in {folder} has model_type {model_type!r}, not {MODEL_TYPE!r}: this is not a "
            "cohere_compass (North-Micro-Vision) checkpoint; load it without compass-compat's checks, "
            "or point at a cohere_compass checkpoint",
            folder=folder,
            file="config.json",
        )


def _check_code_keys(folder: Path, config: Dict[str, Any]) -> List[str]:
    if config.get("model_file"):
        # mlx-vlm >= 0.7 imports config.json's model_file from the checkpoint folder in
        # get_model_and_args, with no opt-in (0.4.4 to 0.6.12 ignore the key).
        raise CheckpointError(
            f"config.json in {folder} declares model_file={config['model_file']!r}: mlx-vlm >= 0.7 would "
            "execute that file. compass-compat never runs code from a checkpoint; remove the "
            "model_file key (cohere_compass needs no checkpoint code)",
            folder=folder,
            file="config.json",
        )
    if "auto_map" in config:
        return ["config.json's auto_map is ignored: no checkpoint code is run (trust_remote_code is never honoured)"]
    return []


def _model_config(folder: Path, config: Dict[str, Any]):
    for key in ("text_config", "vision_config"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise _restore(folder, "config.json", f": {key} must be a JSON object, not {type(config[key]).__name__}")
    model_config_cls = vendored_module("config").ModelConfig
    try:
        return model_config_cls.from_dict(config)
    except (ValueError, TypeError, KeyError) as err:
        raise CheckpointError(
            f"config.json in {folder}: {err}. Fix that value (the published "
            "checkpoint's config.json has the right one)." + _defaulted_hint(config),
            folder=folder,
            file="config.json",
        ) from err


def _check_sub_configs(folder: Path, config: Dict[str, Any]) -> None:
    for key in ("text_config", "vision_config"):
        if not config.get(key):
            raise CheckpointError(
                f"config.json in {folder} has no {key}: the reference's defaults for it describe a "
                f"different model than these weights. Copy the {key} block of the checkpoint's "
                "published config.json",
                folder=folder,
                file="config.json",
            )
    text = config["text_config"]
    if text.get("rope_parameters") is None and text.get("rope_theta") is None:
        # transformers' model raises KeyError without them; the MLX model would silently
        # run every layer without positional encoding.
        raise CheckpointError(
            f"config.json in {folder}: text_config has no rope_parameters, so sliding layers would get "
            "no rotary embedding (transformers refuses such a config). Copy rope_parameters from the "
            'published config.json, e.g. {"sliding_attention": {"rope_type": "default", '
            '"rope_theta": 50000, "mrope_section": [24, 20, 20], "mrope_interleaved": true}, '
            '"full_attention": null}',
            folder=folder,
            file="config.json",
        )


# ------------------------------------------------------------------ preprocessor


def processing_module():
    """The vendored processing_cohere_compass module (its pixel-bound resolution is the one the
    processor and these checks share), the process's one copy."""
    return vendored_module("processing_cohere_compass")


def pixel_bounds(
    folder: Any, load_kwargs: Optional[Dict[str, Any]] = None, call_kwargs: Optional[Dict[str, Any]] = None
):
    """The min / max pixels a cohere_compass processor built from ``folder`` resizes within,
    with their sources (``PixelBounds``; the precedence table is in the vendored image processor's
    "pixel bounds" section). Values are not validated here: :func:`validate_checkpoint` does."""
    return processing_module().read_pixel_bounds(Path(os.fspath(folder)), load_kwargs, call_kwargs)


def _check_image_settings(folder: Path) -> None:
    module = vendored_module("image_processing_cohere_compass")
    settings, source = module.image_processor_settings(
        _read_json(folder, "processor_config.json", required=False),
        _read_json(folder, "preprocessor_config.json", required=False),
    )
    if not isinstance(settings, dict):
        raise _restore(folder, source, f" must be a JSON object, not {type(settings).__name__}")
    tokenizer_config = _read_json(folder, "tokenizer_config.json", required=False) or {}
    for label, values in ((source, settings), ("tokenizer_config.json", tokenizer_config)):
        if values.get("size") is not None and not isinstance(values["size"], dict):
            problem = ": size must be an object with shortest_edge / longest_edge (min / max pixels)"
            raise _restore(folder, label, problem, PUBLISHED_IMAGE_SETTINGS)
    values = {f"size.{k}": v for k, v in (settings.get("size") or {}).items() if k in ("shortest_edge", "longest_edge")}
    values.update({k: settings[k] for k in _PREPROCESSOR_INTS if settings.get(k) is not None})
    bounds = module.resolve_pixel_bounds(settings, source, tokenizer_config)
    checked = [(source, key, value) for key, value in values.items()]
    # The settings file's bounds are checked above: only tokenizer_config.json can give a bad one here.
    checked += [(_file_of(bounds.min_source), "min_pixels", bounds.min_pixels)]
    checked += [(_file_of(bounds.max_source), "max_pixels", bounds.max_pixels)]
    for label, key, value in checked:
        if not _positive_int(value):
            problem = f": {key} must be a positive integer, got {value!r}"
            raise _restore(folder, label, problem, PUBLISHED_IMAGE_SETTINGS)
    if bounds.min_pixels > bounds.max_pixels:
        raise CheckpointError(
            f"{folder}: min pixels {bounds.min_pixels} (from {bounds.min_source}) exceed max pixels "
            f"{bounds.max_pixels} (from {bounds.max_source}); restore the published values",
            folder=folder,
            file=_file_of(bounds.min_source),
        )


def _file_of(source: str) -> Optional[str]:
    return None if source == "default" else source.split()[0]


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# ------------------------------------------------------------------ weight files


def _weight_files(folder: Path, roots: Tuple[str, ...]) -> Tuple[List[str], List[str]]:
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    # Every mlx-vlm pin globs *.safetensors except *consolidated.safetensors.
    files = [n for n in names if n.endswith(".safetensors") and not n.endswith("consolidated.safetensors")]
    index = _read_json(folder, INDEX_FILE, required=False)
    if index is not None:
        # mlx-vlm >= 0.6 reads the shards named by the index (0.4.4 globs only).
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise _restore(folder, INDEX_FILE, " has no weight_map object")
        for shard in sorted(set(map(str, weight_map.values()))):
            _check_reference(folder, shard, roots, what=f"{INDEX_FILE} shard")
            if not (folder / shard).is_file():
                raise _download(
                    folder, INDEX_FILE, f"names shard {shard!r}, which is missing", "the download is incomplete", shard
                )
            if shard not in files:
                files.append(shard)
    ignored = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    return files, ignored


def _read_header(folder: Path, name: str) -> Dict[str, Dict[str, Any]]:
    """Tensor entries of a safetensors header, checked against the file's size."""
    path = folder / name
    size = path.stat().st_size

    def broken(why: str) -> CheckpointError:
        cause = "the download was probably interrupted or the file corrupted"
        return _download(folder, name, f"is not a valid safetensors file ({why})", cause)

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise broken(f"{size} bytes, too short for a header")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise broken(f"its header claims {length} bytes but the file holds {size - 8} after the length")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise broken(f"unreadable header: {err}") from err
    if not isinstance(header, dict):
        raise broken("the header is not a JSON object")
    available = size - 8 - length
    entries, end = {}, 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise broken(f"tensor {key!r} has a malformed entry ({err!r})") from err
        if dtype not in _DTYPE_BYTES or any(d < 0 for d in shape):
            raise broken(f"tensor {key!r} has dtype {dtype!r} and shape {shape}")
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
            raise broken(f"tensor {key!r} has data offsets {[start, stop]}")
        if stop - start != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise broken(f"tensor {key!r} of shape {shape} {dtype} has {stop - start} bytes of data")
        entries[key] = {"dtype": dtype, "shape": tuple(shape), "file": name}
        end = max(end, stop)
    if end > available:
        raise CheckpointError(
            f"{name} in {folder} is truncated: its header describes {end} bytes of tensor data but the file "
            f"holds {available}; the download was interrupted: download the file again",
            folder=folder,
            file=name,
        )
    return entries


# ------------------------------------------------------------------ tensors


def expected_tensors(model_config, tied: Optional[bool] = None) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """``{mlx key: (shape, kind)}`` of every parameter the model has for ``model_config``
    (:func:`compass_data.weight_tree.weight_tree`; kinds ``linear`` and ``embedding`` are
    quantizable, ``conv`` is the patch embedding in MLX layout). ``tied``: the head decision for
    the stored weights (``model_config.head_tied``); None means the head the config alone implies.
    """
    tied = model_config.tie_word_embeddings if tied is None else tied
    return weight_tree(model_config.text_config, model_config.vision_config, tied=tied)


def _defaulted_hint(config: Dict[str, Any]) -> str:
    missing = [f"{sub}.{k}" for sub, keys in SHAPE_KEYS.items() for k in keys if k not in (config.get(sub) or {})]
    if not missing:
        return ""
    return (
        f" config.json leaves {', '.join(missing)} to the reference's defaults, which describe "
        "another model: add those keys from the published config.json."
    )


def _check_tensors(folder: Path, config: Dict[str, Any], model_config, headers) -> None:
    tied = _check_head(folder, model_config, headers)
    weight_key = vendored_module("config").weight_key  # the model's own key mapping
    stored: Dict[str, Dict[str, Any]] = {}
    original: Dict[str, str] = {}
    for entries in headers.values():
        for key, info in entries.items():
            mlx = weight_key(key, tied)
            if mlx is not None:
                stored[mlx] = info
                original[mlx] = key
    expected = expected_tensors(model_config, tied)

    def where(mlx: str) -> str:
        return f"{original[mlx]} (in {stored[mlx]['file']})"

    quantized = sorted(k[: -len(".scales")] for k in stored if k.endswith(".scales"))
    _check_quantization(folder, config, expected, stored, quantized, where)
    qset = set(quantized)

    allowed = set(expected) | {f"{m}.{part}" for m in qset for part in ("scales", "biases")}
    unexpected = sorted(k for k in stored if k not in allowed)
    if unexpected:
        post_norm = any("post_attention_layernorm" in k for k in unexpected)
        whose = "The weights belong to another model or configuration"
        if post_norm:
            whose = "A post_attention_layernorm means these weights are not cohere_compass"
        examples = ", ".join(where(k) for k in unexpected[:5])
        problem = (
            f"{len(unexpected)} stored tensor(s) that the cohere_compass model does not have, e.g. {examples}. {whose}"
        )
        raise _mismatch(folder, problem, config, stored[unexpected[0]]["file"])
    missing = sorted(k for k in expected if k not in stored)
    if missing:
        problem = (
            f"{len(missing)} tensor(s) the model needs are not stored, e.g. {', '.join(missing[:5])}. "
            "The weights are incomplete or for another configuration: re-download the checkpoint if incomplete"
        )
        raise _mismatch(folder, problem, config)
    for key, (shape, kind) in expected.items():
        if key.rsplit(".", 1)[0] in qset:
            continue  # checked with the quantization block
        got = stored[key]["shape"]
        ok = got == shape or (kind == "conv" and got == (shape[0], shape[4], shape[1], shape[2], shape[3]))
        if not ok:
            problem = f"{where(key)} has shape {list(got)} but config.json implies {list(shape)}; config.json and the weights disagree"
            raise _mismatch(folder, problem, config, stored[key]["file"])


def _check_head(folder: Path, model_config, headers) -> bool:
    """The head the stored weights need (``ModelConfig.head_tied``; a stored ``lm_head``
    counts as used: whether it equals the embedding needs the data), or refuse."""
    weight_key = vendored_module("config").weight_key
    lm_head_stored = any(
        (weight_key(key, False) or "").startswith("language_model.lm_head.")
        for entries in headers.values()
        for key in entries
    )
    tied = model_config.head_tied(lm_head_stored)
    top, text = model_config.declared_tie_word_embeddings, model_config.text_config.tie_word_embeddings
    keys = f"tie_word_embeddings is {_key_state(top)} at the top level and {_key_state(text)} in text_config"
    if tied is None:
        raise CheckpointError(
            f"{folder}: no lm_head.weight is stored and config.json does not tie the head to the token "
            f"embedding ({keys}), so the model has no output head (transformers would run a randomly "
            "initialised one). If the head is the embedding, as in the published checkpoint, set "
            '"tie_word_embeddings": true in config.json; otherwise the lm_head weights are missing: '
            "re-download the checkpoint",
            folder=folder,
            file="config.json",
        )
    if tied != model_config.tie_word_embeddings and _loader_skips_sanitize(folder, headers):
        # The loader would build the head from config.json alone and then fail on the weights.
        fix = (
            'set the top-level "tie_word_embeddings": false in config.json to use the stored lm_head '
            "(or delete lm_head from the weights if it is a copy of the embedding)"
            if lm_head_stored
            else 'set the top-level "tie_word_embeddings": true in config.json'
        )
        raise CheckpointError(
            f"{folder}: config.json builds the head {'tied' if model_config.tie_word_embeddings else 'untied'} "
            f"({keys}) but the weights {'store' if lm_head_stored else 'do not store'} lm_head; mlx-vlm "
            f"{version('mlx-vlm')} loads MLX-format weight files without the model's sanitize, "
            f"which settles that: {fix}",
            folder=folder,
            file="config.json",
        )
    return tied


def _key_state(value: Optional[bool]) -> str:
    return "absent" if value is None else json.dumps(bool(value))


def _loader_skips_sanitize(folder: Path, headers) -> bool:
    """Whether this pin's load_model leaves MLX-format files unsanitized (mlx-vlm 0.4.4, 0.6.3;
    read from its source, the releases between were not measured) and some file is one."""
    source = Path(importlib.util.find_spec("mlx_vlm").origin).parent / "utils.py"
    skips = "if not is_mlx_format:" in source.read_text(encoding="utf-8")
    return skips and any(_metadata(folder, name).get("format") == "mlx" for name in headers)


def _metadata(folder: Path, name: str) -> Dict[str, Any]:
    with open(folder / name, "rb") as f:  # the header was checked by _read_header
        (length,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(length)).get("__metadata__")
    return meta if isinstance(meta, dict) else {}


# Quantization modes beyond affine and the (group_size, bits) each needs; whether this install's
# loader passes the mode is measured by compass_compat.probes (docs/testing.md).
QUANT_MODES = {"mxfp4": (32, 4), "mxfp8": (32, 8), "nvfp4": (16, 4)}


def _check_mode(folder: Path, module: str, mode: Any, bits: Any, group: Any) -> None:
    """Refuse a quantization mode this install is measured not to load, before mlx-vlm's loader runs."""
    if mode == "affine":
        return
    mlx_vlm, mlx = version("mlx-vlm"), version("mlx")
    pin = f"mlx-vlm {mlx_vlm} with mlx {mlx}"
    affine = (
        "or use an affine conversion of the model (mlx_vlm.convert -q --q-bits 4 or 8, whose default mode is affine)"
    )
    if mode not in QUANT_MODES:
        raise CheckpointError(
            f"{folder}: config.json's quantization mode {mode!r} (for {module}) is not one compass-compat "
            f"knows ({', '.join(['affine', *QUANT_MODES])}); {pin} is not known to load it: "
            f"re-convert with one of those modes, {affine}",
            folder=folder,
            file="config.json",
        )
    need_group, need_bits = QUANT_MODES[mode]
    if (group, bits) != (need_group, need_bits):
        problem = f"config.json's quantization mode {mode!r} needs group_size {need_group} and bits {need_bits}, but {module} has group_size {group} and bits {bits}"
        raise _config_fix(folder, problem)
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


def _check_quantization(folder: Path, config, expected, stored, quantized, where) -> None:
    block = config.get("quantization")
    if not quantized:
        return
    first = quantized[0]
    if not isinstance(block, dict):
        bits, group = _stored_quantization(expected, stored, first)
        problem = (
            f"{where(first + '.scales')} shows the weights are quantized ({bits}-bit, group size {group}), but "
            "config.json has no quantization block, so the model would be built unquantized"
        )
        raise _config_fix(
            folder, problem, f'Add "quantization": {{"group_size": {group}, "bits": {bits}, "mode": "affine"}} or '
        )
    for module in quantized:
        weight = module + ".weight"
        if weight not in expected or expected[weight][1] not in ("linear", "embedding"):
            continue  # reported as an unexpected tensor
        # Per-module overrides, keyed by module path; mlx-vlm >= 0.6 also matches the path
        # without the "language_model." prefix (text-only conversions).
        settings = block.get(module)
        if settings is None and module.startswith("language_model."):
            settings = block.get(module[len("language_model.") :])
        if settings is None:
            settings = block
        if settings is False:
            problem = f"config.json's quantization block says {module} is not quantized, but {where(module + '.scales')} is stored"
            raise _config_fix(folder, problem)
        settings = settings if isinstance(settings, dict) else block
        want_bits, want_group = settings.get("bits"), settings.get("group_size")
        mode = settings.get("mode", "affine")
        bits, group = _stored_quantization(expected, stored, module)
        if (bits, group) != (want_bits, want_group):
            problem = (
                f"config.json's quantization block says bits={want_bits}, group_size={want_group}, but {where(weight)} is "
                f"stored with {bits} bits and group size {group} (weight {list(stored[weight]['shape'])}, "
                f"scales {list(stored[module + '.scales']['shape'])})"
            )
            raise _config_fix(folder, problem, f'Set quantization to {{"group_size": {group}, "bits": {bits}}} or ')
        _check_mode(folder, module, mode, want_bits, want_group)
        if mode != "affine" and module + ".biases" in stored:
            problem = f"{module} is quantized in mode {mode!r}, which has no biases, but {where(module + '.biases')} is stored"
            raise _config_fix(folder, problem, 'these are affine weights: set the mode to "affine" or ')
        if mode == "affine" and stored.get(module + ".biases", {}).get("shape") != stored[module + ".scales"]["shape"]:
            raise CheckpointError(
                f"{folder}: {module} is quantized in affine mode but its .biases tensor is missing or shaped "
                "unlike its .scales; the weights are incomplete: re-download or re-convert them",
                folder=folder,
                file=stored[module + ".scales"]["file"],
            )


def _stored_quantization(expected, stored, module: str) -> Tuple[Any, Any]:
    """(bits, group_size) implied by a quantized module's stored weight and scales."""
    weight = stored.get(module + ".weight")
    scales = stored[module + ".scales"]
    n_in = expected.get(module + ".weight", ((0, 0), ""))[0][-1]
    if weight is None or not n_in or not weight["shape"] or not scales["shape"] or not scales["shape"][-1]:
        return None, None
    packed, groups = weight["shape"][-1], scales["shape"][-1]
    bits = packed * 32 / n_in
    group = n_in / groups
    return (int(bits) if bits == int(bits) else bits), (int(group) if group == int(group) else group)


__all__ = ["CheckpointError", "CheckpointReport", "expected_tensors", "validate_checkpoint"]
