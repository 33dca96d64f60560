"""Broken copies of the tiny checkpoint, each with what loading it raises: :data:`BROKEN`.

The broken-checkpoint tests assert each error; the process-health tests check that a process keeps
working after each one. Most are refused by the library that reads the file (mlx, mlx-vlm, the
vendored model or processor), its words in one CheckpointError line; :data:`LOADS` are folders the
loader reads correctly as they are. The measured table: docs/checkpoint-files.md.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Tuple

import numpy as np
from safetensors import safe_open

from compass_compat.checkpoint_checks import CheckpointError
from compass_data.tiny import PADDED_VOCAB_SIZE
from tests.support.checkpoints import copy_checkpoint, edit_json, edit_weights


@dataclass(frozen=True)
class Broken:
    """A broken copy of the tiny checkpoint and what ``mlx_vlm.load`` raises on it: ``load`` is
    ``(exception class, regex)``. ``quantized``: the case starts from the 4-bit copy."""

    name: str
    edit: Callable[[Path], None]
    load: Tuple[type, str]
    quantized: bool = False


def _unlink(name):
    return lambda d: (d / name).unlink()


def _config(edit):
    return lambda d: edit_json(d, "config.json", edit)


def _text(edit):
    return _config(lambda c: edit(c["text_config"]))


def _preprocessor(edit):
    return lambda d: edit_json(d, "preprocessor_config.json", edit)


def _truncate(keep: Callable[[int], int]):
    def edit(d):
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: keep(len(data))])

    return edit


def _header(edit):
    """Rewrite model.safetensors' JSON header with ``edit`` (the tensor data kept as it is)."""

    def rewrite(d):
        data = (d / "model.safetensors").read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = edit(json.loads(data[8 : 8 + length]))
        raw = json.dumps(header).encode()
        (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])

    return rewrite


def _first_tensor(edit):
    def change(header):
        edit(header[next(k for k in sorted(header) if k != "__metadata__")])
        return header

    return _header(change)


def _index(index):
    return lambda d: (d / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")


def _first_quantized(edit):
    """``edit(folder, module)`` for the first quantized module (by name) of model.safetensors."""

    def change(d):
        with safe_open(str(d / "model.safetensors"), "numpy") as f:
            keys = list(f.keys())
        edit(d, min(k for k in keys if k.endswith(".scales"))[: -len(".scales")])

    return change


def _pop_weight(key):
    return lambda d: edit_weights(d, lambda w: w.pop(key))


def _set_weight(key, value):
    return lambda d: edit_weights(d, lambda w: w.__setitem__(key, value))


def _set_quantization(block):
    return _config(lambda c: c.__setitem__("quantization", block) if block else c.pop("quantization"))


def _refused(remedy: str, words: str, file: str = "model.safetensors") -> Tuple[type, str]:
    """The CheckpointError wrapping a library's ``words`` with one of the remedies."""
    templates = {
        "download": rf"^{re.escape(file)} in .* cannot be read \({words}\); the download is incomplete or the file "
        r"corrupt: download the checkpoint again$",
        "config": rf"^config\.json in .*: {words}\. Fix that value \(the published config\.json has the right one\)\.",
        "mismatch": rf"^.*: config\.json and the weights disagree \({words}\)\. Use the config\.json published with these "
        r"weights, or the weights published with it\.",
        "image": rf"^.*: {words}\. Restore the image settings published with the checkpoint \(processor_config\.json's "
        r"image_processor block, .*\) \(published: ",
    }
    return CheckpointError, templates[remedy]


BROKEN: List[Broken] = [
    # Folders that are not (recognisably) cohere_compass keep mlx-vlm's own error.
    Broken("missing_config", _unlink("config.json"), (FileNotFoundError, r"^Config not found at ")),
    Broken(
        "model_type_other",
        _config(lambda c: c.__setitem__("model_type", "cohere_compass_text")),
        (ValueError, r"^Model type cohere_compass_text not supported"),
    ),
    # Not JSON: nothing says which model it is, but the guard reports it (a ValueError, as json's).
    Broken(
        "config_not_json",
        lambda d: (d / "config.json").write_text("{not json", encoding="utf-8"),
        _refused("download", r"JSONDecodeError: Expecting property name enclosed in double quotes: .*", "config.json"),
    ),
    # mlx-vlm lower-cases model_type to find the package; the vendored config refuses it.
    Broken(
        "model_type_case",
        _config(lambda c: c.__setitem__("model_type", "Cohere_Compass")),
        _refused(
            "config",
            r"ValueError: config\.json has model_type 'Cohere_Compass'; this package only runs 'cohere_compass' checkpoints",
        ),
    ),
    Broken(
        "no_text_config",
        _config(lambda c: c.pop("text_config")),
        (
            CheckpointError,
            _refused("mismatch", r"ValueError: Missing 256 parameters: language_model\.model\.layers\..* \.\.\.")[1]
            + r" config\.json leaves text_config\.vocab_size",
        ),
    ),
    Broken(
        "text_vocab_size_missing",
        _text(lambda t: t.pop("vocab_size")),
        (
            CheckpointError,
            _refused(
                "mismatch",
                rf"ValueError: Expected shape \(256000, 64\) but received shape \({PADDED_VOCAB_SIZE}, 64\) for "
                r"parameter language_model\.model\.embed_tokens\.weight",
            )[1]
            + r" config\.json leaves text_config\.vocab_size to the reference's defaults",
        ),
    ),
    # Kept: without rope_parameters the MLX model loads and answers wrong (transformers refuses it).
    Broken(
        "text_rope_parameters_missing",
        _text(lambda t: t.pop("rope_parameters")),
        (CheckpointError, r"text_config has no rope_parameters.* Copy rope_parameters from the published config\.json"),
    ),
    Broken(
        "mrope_section_sum",
        _text(lambda t: t["rope_parameters"]["sliding_attention"].__setitem__("mrope_section", [4, 2, 1])),
        _refused(
            "config",
            r"ValueError: text_config\.rope_parameters\['sliding_attention'\]\.mrope_section \[4, 2, 1\] "
            r"sums to 7, but head_dim // 2 is 8",
        ),
    ),
    Broken(
        "missing_tensor",
        _pop_weight("model.language_model.layers.3.mlp.up_proj.weight"),
        _refused(
            "mismatch", r"ValueError: Missing 1 parameters: language_model\.model\.layers\.3\.mlp\.up_proj\.weight\."
        ),
    ),
    Broken(
        "unexpected_tensor",
        _set_weight("model.language_model.layers.0.post_attention_layernorm.weight", np.ones(64, np.float32)),
        _refused(
            "mismatch",
            r"ValueError: Received 1 parameters not in model: "
            r"language_model\.model\.layers\.0\.post_attention_layernorm\.weight\.",
        ),
    ),
    Broken(
        "wrong_shape",
        _set_weight("model.language_model.layers.1.self_attn.k_proj.weight", np.zeros((8, 64), np.float32)),
        _refused(
            "mismatch",
            r"ValueError: Expected shape \(32, 64\) but received shape \(8, 64\) for parameter "
            r"language_model\.model\.layers\.1\.self_attn\.k_proj\.weight",
        ),
    ),
    # The safetensors file itself: mlx's own refusals (mlx 0.32.4 words; the process stays healthy).
    Broken(
        "truncated_weights",
        _truncate(lambda n: n // 2),
        _refused(
            "download",
            r"RuntimeError: \[load_safetensors\] Tensor '.*' invalid data offsets \(\d+, \d+\) exceeding "
            r"the size of the file\..*",
        ),
    ),
    Broken(
        "truncated_header",
        _truncate(lambda n: 100),
        _refused(
            "download",
            r"RuntimeError: \[load_safetensors\] The JSON header is \d+ bytes long but the file is only "
            r"100 bytes\..*",
        ),
    ),
    Broken("weights_too_short", _truncate(lambda n: 4), _refused("download", r"RuntimeError: .*")),
    Broken("header_not_an_object", _header(lambda h: [h]), _refused("download", r"RuntimeError: .*")),
    Broken(
        "header_unknown_dtype",
        _first_tensor(lambda t: t.__setitem__("dtype", "Q9")),
        _refused("download", r"RuntimeError: .*Q9.*"),
    ),
    Broken(
        "header_shape_disagrees_with_its_bytes",
        _first_tensor(lambda t: t.__setitem__("shape", [2 * t["shape"][0], *t["shape"][1:]])),
        _refused("download", r"RuntimeError: \[load_safetensors\] Tensor '.*' invalid data offsets .*"),
    ),
    Broken(
        "quantization_bits_disagree",
        _set_quantization({"group_size": 32, "bits": 8}),
        _refused("mismatch", r"ValueError: Expected shape \(576, 16\) but received shape \(576, 8\) for parameter .*"),
        quantized=True,
    ),
    Broken(
        "quantization_block_missing",
        _set_quantization(None),
        _refused("mismatch", r"ValueError: Received 164 parameters not in model: .*"),
        quantized=True,
    ),
    Broken(
        "preprocessor_min_pixels_zero",
        _preprocessor(lambda p: p["size"].__setitem__("shortest_edge", 0)),
        _refused(
            "image",
            r"ValueError: cohere_compass image processor: `size\.shortest_edge \(min_pixels\)` must be a "
            r"positive integer, got 0",
        ),
    ),
]

# Read right (mlx-vlm 0.6.12 quantizes every module whose scales are stored) or refused in one
# line (0.4.4 and 0.7 build the module unquantized, and the stored scales fail the strict load).
OVERRIDE = Broken(
    "quantization_override_says_unquantized",
    _first_quantized(lambda d, m: edit_json(d, "config.json", lambda c: c["quantization"].__setitem__(m, False))),
    _refused("mismatch", r"ValueError: Received 2 parameters not in model: .*"),
    quantized=True,
)

# Inconsistent, but the loader reads them correctly as they are (each answers as its base copy):
# mlx-vlm 0.6.12 / 0.7.10 glob the *.safetensors when the index is unusable.
LOADS: List[Broken] = [
    Broken("index_without_weight_map", _index({"metadata": {}}), (type(None), "")),
    Broken(
        "index_names_a_missing_shard",
        _index({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}),
        (type(None), ""),
    ),
]


def make_broken(case: Broken, good: Path, quantized: Path, where: Path) -> Path:
    folder = copy_checkpoint(quantized if case.quantized else good, where / case.name)
    case.edit(folder)
    return folder
