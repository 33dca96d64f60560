"""The control model (scripts/_lib/control.py): a tiny mlx-vlm qwen3_vl built locally, which the
conformance and feature tests drive beside ours. Checked here on the installed pin: the build is
deterministic and idempotent, the pin loads exactly the built values, the cases have the shapes the
grids call for, pixels reach the logits, the greedy paths agree, and the pin's own qwen3_vl defects
are the ones the table lists."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_vlm
import numpy as np
import pytest
from mlx.utils import tree_flatten

from scripts._lib import control

VERSION = str(mlx_vlm.__version__)
STEPS = 6


@pytest.fixture(scope="module")
def model(control_ckpt):
    return control.load_control(control_ckpt)


def test_two_builds_are_byte_identical_and_a_rebuild_writes_nothing(control_ckpt, tmp_path):
    again = control.build_control(tmp_path / "again")
    for name in control.FILES:
        assert (again / name).read_bytes() == (control_ckpt / name).read_bytes(), name
    record = json.loads((again / control.FINGERPRINT_FILE).read_text())
    assert record["weights_sha256"] == control.weights_sha256(control.control_weights(0))

    stamps = {name: (again / name).stat().st_mtime_ns for name in control.FILES}
    control.build_control(again)
    assert {name: (again / name).stat().st_mtime_ns for name in control.FILES} == stamps

    # A damaged file is rewritten; another seed gives other weights.
    (again / "model.safetensors").write_bytes(b"\0" * 16)
    control.build_control(again)
    assert (again / "model.safetensors").read_bytes() == (control_ckpt / "model.safetensors").read_bytes()
    other = control.build_control(tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (control_ckpt / "model.safetensors").read_bytes()


def test_the_pin_loads_exactly_the_built_weights(model):
    assert type(model).__module__ == "mlx_vlm.models.qwen3_vl.qwen3_vl"
    built = control.control_weights(0)
    loaded = dict(tree_flatten(model.parameters()))
    assert len(loaded) == len(built)
    for key, value in built.items():
        if key.startswith("model.language_model."):
            key = "language_model.model." + key[len("model.language_model.") :]
        elif key.startswith("model.visual."):
            key = "vision_tower." + key[len("model.visual.") :]
        elif key.startswith("lm_head."):
            key = "language_model." + key
        if key.endswith("patch_embed.proj.weight"):  # torch [O, C, T, P, P] -> MLX [O, T, P, P, C]
            value = value.transpose(0, 2, 3, 4, 1)
        np.testing.assert_array_equal(np.array(loaded[key]), value, err_msg=key)


@pytest.mark.parametrize("case", sorted(control.CASES))
def test_case_shapes_and_finite_logits(model, case):
    inputs = control.control_prompt(case)
    runs, grids = control.CASES[case]
    ids = np.array(inputs["input_ids"])[0]
    tokens = [control.image_token_count(g) for g in grids]
    assert ids.shape == (sum(runs) + sum(tokens) + 2 * len(grids),)
    assert int((ids == control.IMAGE_ID).sum()) == sum(tokens)
    assert int((ids == control.VISION_START_ID).sum()) == int((ids == control.VISION_END_ID).sum()) == len(grids)
    if grids:
        assert inputs["pixel_values"].shape == (sum(t * h * w for t, h, w in grids), control.PATCH_DIM)
        assert np.array(inputs["image_grid_thw"]).tolist() == [list(g) for g in grids]
    logits = control.one_shot_logits(model, inputs)
    assert logits.shape == (ids.size, control.VOCAB_SIZE)
    assert np.isfinite(logits).all()
    # Same case, same inputs: the same logits bit for bit.
    np.testing.assert_array_equal(control.one_shot_logits(model, control.control_prompt(case)), logits)


@pytest.mark.parametrize("case", ["image", "two_images"])
def test_pixels_reach_the_logits_and_only_after_the_first_image(model, case):
    inputs = control.control_prompt(case)
    ids = np.array(inputs["input_ids"])[0]
    first = int(np.argmax(ids == control.IMAGE_ID))
    base = control.one_shot_logits(model, inputs)
    other = control.one_shot_logits(model, control.control_prompt(case, pixel_seed=7))
    # Causal: the text before the first image token cannot see the pixels.
    np.testing.assert_allclose(other[:first], base[:first], rtol=0, atol=1e-6)
    assert (np.abs(other[first:] - base[first:]).max(axis=-1) > 1e-3).all()
    assert np.abs(other[-1] - base[-1]).max() > 0.1


def test_a_picture_patchifies_into_the_grid_it_names(model):
    rng = np.random.default_rng(3)
    picture = rng.integers(0, 256, size=(64, 96, 3), dtype=np.uint8)
    rows, grid = control.patchify(picture)
    assert grid == control.CASES["image"][1][0] == (1, 4, 6)
    # Row 1 is the second patch of the first merge block: picture rows 0-15, columns 16-31.
    patch = rows[1].reshape(3, 2, 16, 16)
    expected = (picture[0:16, 16:32].transpose(2, 0, 1).astype(np.float32) / 255.0 - 0.5) / 0.5
    np.testing.assert_allclose(patch[:, 0], expected, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(patch[:, 0], patch[:, 1])
    # Row 2 starts the merge block's second row: picture rows 16-31, columns 0-15.
    expected = (picture[16:32, 0:16].transpose(2, 0, 1).astype(np.float32) / 255.0 - 0.5) / 0.5
    np.testing.assert_allclose(rows[2].reshape(3, 2, 16, 16)[:, 0], expected, rtol=0, atol=1e-6)
    logits = control.one_shot_logits(model, control.control_prompt("image", pixel_values=rows))
    assert np.isfinite(logits).all()


@pytest.mark.parametrize("case", sorted(control.CASES))
def test_greedy_paths_agree(model, case):
    inputs = control.control_prompt(case)
    reference = control.recompute_greedy(model, inputs, STEPS)
    assert reference[0] == int(np.argmax(control.one_shot_logits(model, inputs)[-1]))
    assert control.one_shot_greedy(model, inputs, STEPS) == reference
    assert control.pin_greedy(model, inputs, STEPS) == reference


def test_positions_of_one_image_follow_the_rule(model):
    inputs = control.control_prompt("image")
    control.fresh_state(model)
    positions, delta = model.language_model.get_rope_index(
        inputs["input_ids"], inputs["image_grid_thw"], None, inputs["mask"]
    )
    expected = control.expected_positions(inputs)
    np.testing.assert_array_equal(np.array(positions)[:, 0, :], expected)
    assert int(mx.array(delta).reshape(-1)[0].item()) == expected.max() + 1 - expected.shape[1]


def test_the_pin_has_exactly_the_listed_qwen3_vl_defects(model):
    found = control.probe_pin_defects(model)
    assert found == control.expected_pin_defects(VERSION), (
        f"mlx-vlm {VERSION}: update control.KNOWN_PIN_DEFECTS (and docs/testing.md) if the pin changed"
    )
