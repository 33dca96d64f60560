"""Text path against transformers' recorded outputs on the same tiny weights."""

import mlx.core as mx
import pytest

from scripts._lib.parity import assert_decode_steps_match, assert_prefill_matches, chunked_prefill, greedy, prefill
from tests.lib.vendored import vendored

vendored()

TEXT_CASES = ["text_short", "text_medium", "text_long"]
TOL = 1e-4


@pytest.fixture(scope="module", params=["original", "mlx"])
def model(request, tiny_ckpt_original, tiny_ckpt_mlx):
    from mlx_vlm.utils import load_model

    path = tiny_ckpt_original if request.param == "original" else tiny_ckpt_mlx
    return load_model(path)


@pytest.mark.parametrize("name", TEXT_CASES)
def test_prefill_logits_match_reference(model, reference, name):
    assert_prefill_matches(model, reference(name), name, TOL)


@pytest.mark.parametrize("name", TEXT_CASES)
def test_decode_steps_match_reference(model, reference, name):
    assert_decode_steps_match(model, reference(name), name, TOL)


@pytest.mark.parametrize("name", TEXT_CASES)
def test_free_running_greedy_ids_match_reference(model, reference, name):
    case = reference(name)
    assert greedy(model, case, len(case["greedy_ids"])) == case["greedy_ids"].tolist()


@pytest.mark.parametrize("chunk", [7, 24])
def test_chunked_prefill_equals_one_shot(model, reference, chunk):
    case = reference("text_long")
    one = prefill(model, case)
    chunked = chunked_prefill(model, case, chunk)
    assert mx.abs(one - chunked).max().item() < 1e-5


def test_long_prompt_exceeds_three_windows(reference, tiny_ckpt_original):
    import json

    window = json.loads((tiny_ckpt_original / "config.json").read_text())["text_config"]["sliding_window"]
    assert reference("text_long")["input_ids"].shape[1] >= 3 * window
