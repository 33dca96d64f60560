"""Broken copies of the tiny checkpoint, each with what loading it raises: :data:`BROKEN`.

The broken-checkpoint tests assert each error exactly; the process-health tests check that a
process keeps working after each one.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Tuple

import numpy as np
from safetensors import safe_open

from compass_compat.checkpoint_checks import CheckpointError
from compass_data.tiny import PADDED_VOCAB_SIZE
from tests.lib.checkpoints import copy_checkpoint, edit_json, edit_weights


@dataclass(frozen=True)
class Broken:
    """A broken copy of the tiny checkpoint and what each way of loading it raises.

    ``load`` is ``(exception class, regex)`` for ``mlx_vlm.load`` on this pin (regex None: the
    ``check`` one); ``check`` the
    regex of :class:`CheckpointError` from ``validate_checkpoint``. ``quantized``: the case
    starts from the 4-bit copy.
    """

    name: str
    edit: Callable[[Path], None]
    load: Tuple[type, str]
    check: str
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


_PP = r"preprocessor_config\.json in .*: {} must be a positive integer, got {}; restore it from the published"
# The shim's loader guard runs validate_checkpoint first for folders whose config.json says
# cohere_compass, so mlx_vlm.load raises the same CheckpointError as the check.
GUARDED = (CheckpointError, None)

BROKEN: List[Broken] = [
    # Folders that are not (recognisably) cohere_compass keep mlx-vlm's own error.
    Broken(
        "missing_config",
        _unlink("config.json"),
        (FileNotFoundError, r"^Config not found at "),
        r"has no config\.json; a checkpoint folder needs the config\.json published with its weights",
    ),
    # Not JSON: nothing says which model it is, but the guard reports it (a ValueError, as json's).
    Broken(
        "config_not_json",
        lambda d: (d / "config.json").write_text("{not json", encoding="utf-8"),
        GUARDED,
        r"config\.json in .* is not valid JSON \(Expecting property name .* at line 1, column 2\); restore",
    ),
    Broken(
        "model_type_other",
        _config(lambda c: c.__setitem__("model_type", "cohere_compass_text")),
        (ValueError, r"^Model type cohere_compass_text not supported"),
        r"model_type 'cohere_compass_text', not 'cohere_compass': this is not a cohere_compass",
    ),
    # mlx-vlm lower-cases model_type to find the package, so this one reaches the guard.
    Broken(
        "model_type_case",
        _config(lambda c: c.__setitem__("model_type", "Cohere_Compass")),
        GUARDED,
        r"model_type 'Cohere_Compass', not 'cohere_compass'",
    ),
    Broken(
        "no_text_config",
        _config(lambda c: c.pop("text_config")),
        GUARDED,
        r"config\.json in .* has no text_config: the reference's defaults .* Copy the text_config block",
    ),
    Broken(
        "no_vision_config",
        _config(lambda c: c.pop("vision_config")),
        GUARDED,
        r"has no vision_config: .* Copy the vision_config block",
    ),
    Broken(
        "text_hidden_size_missing",
        _text(lambda t: t.pop("hidden_size")),
        GUARDED,
        r"sums to 8, but head_dim // 2 is 1024\. .* leaves text_config\.hidden_size to the reference's defaults",
    ),
    Broken(
        "text_vocab_size_missing",
        _text(lambda t: t.pop("vocab_size")),
        GUARDED,
        rf"embed_tokens\.weight \(in model\.safetensors\) has shape \[{PADDED_VOCAB_SIZE}, 64\] but config\.json implies "
        r"\[256000, 64\].* leaves text_config\.vocab_size to the reference's defaults",
    ),
    Broken(
        "vision_out_hidden_size_missing",
        _config(lambda c: c["vision_config"].pop("out_hidden_size")),
        GUARDED,
        r"has shape \[64, 128\] but config\.json implies \[3584, 128\].*vision_config\.out_hidden_size",
    ),
    # The reference cannot build a model without rope_parameters (KeyError); the vendored
    # config would silently run every layer without rotation, so the check refuses it.
    Broken(
        "text_rope_parameters_missing",
        _text(lambda t: t.pop("rope_parameters")),
        GUARDED,
        r"text_config has no rope_parameters.* Copy rope_parameters from the published config\.json",
    ),
    Broken(
        "layer_types_length",
        _text(lambda t: t.__setitem__("layer_types", ["full_attention"] * 3)),
        GUARDED,
        r"layer_types has 3 entries but num_hidden_layers is 8; give one type per layer\. Fix that value",
    ),
    Broken(
        "mrope_section_sum",
        _text(lambda t: t["rope_parameters"]["sliding_attention"].__setitem__("mrope_section", [4, 2, 1])),
        GUARDED,
        r"mrope_section \[4, 2, 1\] sums to 7, but head_dim // 2 is 8\. Fix that value",
    ),
    Broken(
        "missing_tensor",
        _pop_weight("model.language_model.layers.3.mlp.up_proj.weight"),
        GUARDED,
        r"1 tensor\(s\) the model needs are not stored, e\.g\. "
        r"language_model\.model\.layers\.3\.mlp\.up_proj\.weight\."
        r" The weights are incomplete or for another configuration: re-download",
    ),
    Broken(
        "unexpected_tensor",
        _set_weight("model.language_model.layers.0.post_attention_layernorm.weight", np.ones(64, np.float32)),
        GUARDED,
        r"1 stored tensor\(s\) that the cohere_compass model does not have, e\.g\. "
        r"model\.language_model\.layers\.0\."
        r"post_attention_layernorm\.weight .*A post_attention_layernorm means these weights are not cohere_compass",
    ),
    Broken(
        "wrong_shape",
        _set_weight("model.language_model.layers.1.self_attn.k_proj.weight", np.zeros((8, 64), np.float32)),
        GUARDED,
        r"model\.language_model\.layers\.1\.self_attn\.k_proj\.weight \(in model\.safetensors\) has shape \[8, 64\] "
        r"but config\.json implies \[32, 64\]; config\.json and the weights disagree",
    ),
    Broken(
        "truncated_weights",
        _truncate(lambda n: n // 2),
        GUARDED,
        r"model\.safetensors in .* is truncated: its header describes \d+ bytes of tensor data but the file "
        r"holds \d+; the download was interrupted: download the file again",
    ),
    Broken(
        "truncated_header",
        _truncate(lambda n: 100),
        GUARDED,
        r"model\.safetensors in .* is not a valid safetensors file \(its header claims \d+ bytes but the file "
        r"holds 92 after the length\); .*download it again",
    ),
    Broken(
        "weights_too_short",
        _truncate(lambda n: 4),
        GUARDED,
        r"model\.safetensors in .* is not a valid safetensors file \(4 bytes, too short for a header\); .*download it again",
    ),
    Broken(
        "header_not_an_object",
        _header(lambda h: [h]),
        GUARDED,
        r"model\.safetensors in .* is not a valid safetensors file \(the header is not a JSON object\)",
    ),
    Broken(
        "header_entry_without_dtype",
        _first_tensor(lambda t: t.pop("dtype")),
        GUARDED,
        r"model\.safetensors in .* is not a valid safetensors file \(tensor '.*' has a malformed entry \(KeyError\('dtype'\)\)\)",
    ),
    Broken(
        "header_unknown_dtype",
        _first_tensor(lambda t: t.__setitem__("dtype", "Q9")),
        GUARDED,
        r"model\.safetensors in .* is not a valid safetensors file \(tensor '.*' has dtype 'Q9' and shape \[",
    ),
    Broken(
        "header_offsets_reversed",
        _first_tensor(lambda t: t.__setitem__("data_offsets", t["data_offsets"][::-1])),
        GUARDED,
        r"model\.safetensors in .* is not a valid safetensors file \(tensor '.*' has data offsets \[\d+, \d+\]\)",
    ),
    Broken(
        "header_shape_disagrees_with_its_bytes",
        _first_tensor(lambda t: t.__setitem__("shape", [2 * t["shape"][0], *t["shape"][1:]])),
        GUARDED,
        r"model\.safetensors in .* is not a valid safetensors file \(tensor '.*' of shape \[.*\] \w+ has \d+ bytes of data\)",
    ),
    Broken(
        "index_without_weight_map",
        _index({"metadata": {}}),
        GUARDED,
        r"model\.safetensors\.index\.json in .* has no weight_map object; restore it from the published checkpoint",
    ),
    Broken(
        "index_names_a_missing_shard",
        _index({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}),
        GUARDED,
        r"model\.safetensors\.index\.json in .* names shard 'model-00002-of-00002\.safetensors', which is missing; "
        r"the download is incomplete: download it again",
    ),
    Broken(
        "quantization_bits_disagree",
        _set_quantization({"group_size": 32, "bits": 8}),
        GUARDED,
        r"quantization block says bits=8, group_size=32, but .* is stored with 4 bits and group size 32 .*"
        r"Set quantization to \{\"group_size\": 32, \"bits\": 4\}",
        quantized=True,
    ),
    Broken(
        "quantization_group_disagree",
        _set_quantization({"group_size": 64, "bits": 4}),
        GUARDED,
        r"says bits=4, group_size=64, but .* is stored with 4 bits and group size 32",
        quantized=True,
    ),
    Broken(
        "quantization_block_missing",
        _set_quantization(None),
        GUARDED,
        r"shows the weights are quantized \(4-bit, group size 32\), but config\.json has no quantization block.*"
        r"Add \"quantization\": \{\"group_size\": 32, \"bits\": 4, \"mode\": \"affine\"\}",
        quantized=True,
    ),
    Broken(
        "quantization_override_says_unquantized",
        _first_quantized(lambda d, m: edit_json(d, "config.json", lambda c: c["quantization"].__setitem__(m, False))),
        GUARDED,
        r"config\.json's quantization block says .* is not quantized, but .*\.scales \(in model\.safetensors\) is stored",
        quantized=True,
    ),
    Broken(
        "quantization_biases_missing",
        _first_quantized(lambda d, m: edit_weights(d, lambda w: w.pop(m + ".biases"))),
        GUARDED,
        r"is quantized in affine mode but its \.biases tensor is missing or shaped unlike its \.scales; the weights "
        r"are incomplete: re-download or re-convert them",
        quantized=True,
    ),
    Broken(
        "preprocessor_min_pixels_zero",
        _preprocessor(lambda p: p["size"].__setitem__("shortest_edge", 0)),
        GUARDED,
        _PP.format(r"size\.shortest_edge", "0"),
    ),
    Broken(
        "preprocessor_max_pixels_negative",
        _preprocessor(lambda p: p["size"].__setitem__("longest_edge", -1)),
        GUARDED,
        _PP.format(r"size\.longest_edge", "-1"),
    ),
    Broken(
        "preprocessor_patch_size_negative",
        _preprocessor(lambda p: p.__setitem__("patch_size", -16)),
        GUARDED,
        _PP.format("patch_size", "-16"),
    ),
]


def make_broken(case: Broken, good: Path, quantized: Path, where: Path) -> Path:
    folder = copy_checkpoint(quantized if case.quantized else good, where / case.name)
    case.edit(folder)
    return folder
