"""Broken checkpoints (tests/support/broken_checkpoints.py): ``mlx_vlm.load`` raises one line naming the
file and the remedy. Most are the refusal of the library that reads the file (mlx, mlx-vlm, the
vendored model or processor) with its words kept; ``validate_checkpoint`` refuses only what the
library would load unsafely (docs/checkpoint-files.md has the measured table).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.broken_checkpoints import BROKEN, LOADS, OVERRIDE, make_broken
from tests.support.checkpoints import quantize_checkpoint
from tests.support.host_calls import MAX_TOKENS, generate, load
from tests.support.vendored import vendored

compass = vendored("cohere_compass")

import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from compass_compat.checkpoint_checks import CheckpointError, validate_checkpoint  # noqa: E402
from compass_data.weight_tree import weight_tree  # noqa: E402


@pytest.fixture(scope="session")
def quantized_ckpt(tiny_ckpt_original, tmp_path_factory) -> Path:
    return quantize_checkpoint(tiny_ckpt_original, tmp_path_factory.mktemp("q4") / "ckpt")


def test_the_good_checkpoints_pass_the_checks(tiny_ckpt_original, tiny_ckpt_mlx, quantized_ckpt):
    for folder in (tiny_ckpt_original, tiny_ckpt_mlx, quantized_ckpt):
        validate_checkpoint(folder)


def test_quantized_checkpoint_loads_and_generates(quantized_ckpt, reference):
    loaded = load(quantized_ckpt)
    assert isinstance(loaded[0].language_model.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert len(generate(loaded, reference("text_short")["meta"]["prompt"])) == MAX_TOKENS


def test_weight_tree_matches_the_model_tree(tiny_ckpt_original):
    """compass_data.weight_tree (the tiny checkpoint's tensors) agrees with the vendored module tree."""
    config = json.loads((tiny_ckpt_original / "config.json").read_text())
    for tie, bias in ((True, False), (False, True)):
        config["tie_word_embeddings"] = tie
        config["text_config"]["attention_bias"] = bias
        model_config = compass.ModelConfig.from_dict(config)
        tree = {k: tuple(v.shape) for k, v in tree_flatten(compass.Model(model_config).parameters())}
        want = weight_tree(model_config.text_config, model_config.vision_config, tied=tie)
        assert tree == {k: shape for k, (shape, _) in want.items()}


@pytest.mark.parametrize("case", BROKEN, ids=lambda c: c.name)
def test_broken_checkpoint_load_error(case, tiny_ckpt_original, quantized_ckpt, tmp_path):
    folder = make_broken(case, tiny_ckpt_original, quantized_ckpt, tmp_path)
    exc, pattern = case.load
    with pytest.raises(exc, match="(?s)" + pattern) as info:
        load(folder)
    assert type(info.value) is exc
    if exc is CheckpointError:
        assert "\n" not in str(info.value) and info.value.folder == folder


@pytest.mark.parametrize("case", LOADS, ids=lambda c: c.name)
def test_inconsistent_checkpoint_the_loader_reads_correctly(
    case, tiny_ckpt_original, quantized_ckpt, tmp_path, reference
):
    folder = make_broken(case, tiny_ckpt_original, quantized_ckpt, tmp_path)
    prompt = reference("text_short")["meta"]["prompt"]
    base = quantized_ckpt if case.quantized else tiny_ckpt_original
    assert generate(load(folder), prompt) == generate(load(base), prompt)


def test_an_override_calling_stored_scales_unquantized_is_read_right_or_refused(
    tiny_ckpt_original, quantized_ckpt, tmp_path, reference
):
    """Never a silent wrong answer: the pin reads the stored scales, or refuses in one line."""
    folder = make_broken(OVERRIDE, tiny_ckpt_original, quantized_ckpt, tmp_path)
    prompt = reference("text_short")["meta"]["prompt"]
    exc, pattern = OVERRIDE.load
    try:
        loaded = load(folder)
    except exc as err:
        assert re.search("(?s)" + pattern, str(err)) and "\n" not in str(err), err
        return
    assert generate(loaded, prompt) == generate(load(quantized_ckpt), prompt)
