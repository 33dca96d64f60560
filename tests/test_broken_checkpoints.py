"""Broken checkpoints: each case (tests/lib/broken_checkpoints.py) asserts the exact error class
and a message that says what to do, twice: what ``mlx_vlm.load`` raises on this pin (mlx-vlm's
loader reads config.json and the weights before any compass-compat code runs, so some of those
errors are mlx-vlm's or MLX's own) and what
``compass_compat.checkpoint_checks.validate_checkpoint`` (the pre-flight a host can run, and that
the vendored processor runs on every load) raises. Per-pin differences are spelled out next to
the case.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.lib.broken_checkpoints import BROKEN, make_broken
from tests.lib.checkpoints import quantize_checkpoint
from tests.lib.host_calls import MAX_TOKENS, generate, load
from tests.lib.vendored import vendored

compass = vendored("cohere_compass")

import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from compass_compat.checkpoint_checks import CheckpointError, expected_tensors, validate_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def quantized_ckpt(tiny_ckpt_original, tmp_path_factory) -> Path:
    return quantize_checkpoint(tiny_ckpt_original, tmp_path_factory.mktemp("q4") / "ckpt")


def test_the_good_checkpoints_pass_every_check(tiny_ckpt_original, tiny_ckpt_mlx, quantized_ckpt):
    for folder in (tiny_ckpt_original, tiny_ckpt_mlx):
        report = validate_checkpoint(folder)
        assert report.weight_files == ("model.safetensors",) and report.quantization is None
    assert validate_checkpoint(quantized_ckpt).quantization == {"group_size": 32, "bits": 4}


def test_quantized_checkpoint_loads_and_generates(quantized_ckpt, reference):
    loaded = load(quantized_ckpt)
    assert isinstance(loaded[0].language_model.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert len(generate(loaded, reference("text_short")["meta"]["prompt"])) == MAX_TOKENS


def test_expected_tensors_match_the_model_tree(tiny_ckpt_original):
    """The arithmetic in checkpoint_checks agrees with the vendored module tree."""
    config = json.loads((tiny_ckpt_original / "config.json").read_text())
    for tie, bias in ((True, False), (False, True)):
        config["tie_word_embeddings"] = tie
        config["text_config"]["attention_bias"] = bias
        model_config = compass.ModelConfig.from_dict(config)
        tree = {k: tuple(v.shape) for k, v in tree_flatten(compass.Model(model_config).parameters())}
        assert tree == {k: shape for k, (shape, _) in expected_tensors(model_config).items()}


@pytest.mark.parametrize("case", BROKEN, ids=lambda c: c.name)
def test_broken_checkpoint_load_error(case, tiny_ckpt_original, quantized_ckpt, tmp_path):
    folder = make_broken(case, tiny_ckpt_original, quantized_ckpt, tmp_path)
    exc, pattern = case.load
    pattern = pattern_dotall(case.check) if pattern is None else pattern
    with pytest.raises(exc, match=pattern) as info:
        load(folder)
    assert type(info.value) is exc


@pytest.mark.parametrize("case", BROKEN, ids=lambda c: c.name)
def test_broken_checkpoint_validation_error(case, tiny_ckpt_original, quantized_ckpt, tmp_path):
    folder = make_broken(case, tiny_ckpt_original, quantized_ckpt, tmp_path)
    with pytest.raises(CheckpointError, match=pattern_dotall(case.check)) as info:
        validate_checkpoint(folder)
    assert type(info.value) is CheckpointError and isinstance(info.value, ValueError)
    assert info.value.folder == folder


def pattern_dotall(pattern: str) -> str:
    return "(?s)" + pattern
