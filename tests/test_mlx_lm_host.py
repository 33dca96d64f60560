"""Hosts that load through mlx-lm: the opt-in ``mlx_lm.models.cohere_compass``.

With ``apply_patch(mlx_lm=True)`` (``COMPASS_COMPAT_MLX_LM=1``) ``mlx_lm.load`` runs the
vendored text decoder; expectations are transformers' recorded greedy ids and logits. It
stays off by default, because an mlx-lm model cannot know an image prompt's rope delta:
the last test measures what a host decoding an image prompt with it would get.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import mlx_lm.models
import numpy as np
import pytest

import compass_compat
from compass_compat import CompassCompatError, apply_patch, remove_patch
from compass_compat._patch import MLX_LM_ENV
from tests.support.parity import greedy, prefill
from tests.support.vendored import PACKAGE, is_vendored_file

TEXT_CASES = ["text_short", "text_medium", "text_long"]
TOL = 1e-4  # as tests/test_parity.py
LM_DIR = compass_compat.vendor_root() / "mlx_lm" / "models"
LM_PACKAGE = "mlx_lm.models.cohere_compass"
ENV_ON = os.environ.get(MLX_LM_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def vendored_live() -> bool:
    import importlib

    return is_vendored_file(importlib.import_module(PACKAGE).__file__ or "")


def lm_path_entries() -> list:
    return [p for p in mlx_lm.models.__path__ if os.path.realpath(p) == os.path.realpath(LM_DIR)]


def restore_session_patch(saved: dict) -> None:
    """Back to the session's default patch, with the module objects other test files imported."""
    remove_patch()
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    sys.modules.update(saved)
    import mlx_vlm.models

    if PACKAGE in saved:
        mlx_vlm.models.cohere_compass = saved[PACKAGE]
    apply_patch()


@pytest.fixture(scope="module")
def registered():
    if not vendored_live():
        pytest.skip(
            "upstream mlx-vlm's cohere_compass is live on this pin and the mlx-lm model reuses the vendored "
            "decoder; tested in the pin's default run (test_refused_while_upstream_is_live runs here)"
        )
    saved = {n: m for n, m in sys.modules.items() if n == PACKAGE or n.startswith(PACKAGE + ".")}
    apply_patch(mlx_lm=True)
    yield
    restore_session_patch(saved)


@pytest.fixture(scope="module", params=["original", "mlx"])
def loaded(request, registered, tiny_ckpt_original, tiny_ckpt_mlx):
    path = tiny_ckpt_original if request.param == "original" else tiny_ckpt_mlx
    model, tokenizer = mlx_lm.load(str(path))
    return model, tokenizer, path


# ------------------------------------------------------------- registration


def test_off_by_default():
    if ENV_ON:
        pytest.skip(f"{MLX_LM_ENV} is set in this environment")
    assert lm_path_entries() == []
    assert LM_PACKAGE not in sys.modules or not is_vendored_file(sys.modules[LM_PACKAGE].__file__ or "")


def test_load_resolves_the_vendored_module_at_the_end_of_the_path(loaded):
    model, _, _ = loaded
    assert type(model).__module__ == LM_PACKAGE
    assert Path(sys.modules[LM_PACKAGE].__file__).resolve() == (LM_DIR / "cohere_compass.py").resolve()
    assert len(lm_path_entries()) == 1
    assert os.path.realpath(mlx_lm.models.__path__[-1]) == os.path.realpath(LM_DIR)
    # One copy of the decoder: the mlx-lm model is built from the vendored mlx-vlm classes.
    decoder = sys.modules[PACKAGE + ".language"]
    assert type(model.language_model) is decoder.LanguageModel


def test_vision_weights_are_not_loaded(loaded):
    from mlx.utils import tree_flatten

    model, _, _ = loaded
    names = [k for k, _ in tree_flatten(model.parameters())]
    assert names and all(k.startswith("language_model.model.") for k in names)


def test_sanitize_maps_both_layouts_and_is_idempotent(loaded, tiny_ckpt_original, tiny_ckpt_mlx):
    model, _, _ = loaded
    by_layout = {}
    for path in (tiny_ckpt_original, tiny_ckpt_mlx):
        weights = mx.load(str(Path(path) / "model.safetensors"))
        once = model.sanitize(weights)
        assert model.sanitize(once).keys() == once.keys()
        by_layout[str(path)] = set(once)
    assert by_layout[str(tiny_ckpt_original)] == by_layout[str(tiny_ckpt_mlx)]


# ------------------------------------------------------------------ parity


@pytest.mark.parametrize("name", TEXT_CASES)
def test_stream_generate_greedy_ids_equal_reference(loaded, reference, name):
    model, tokenizer, _ = loaded
    case = reference(name)
    ids = case["input_ids"][0].tolist()
    got = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=len(case["greedy_ids"]))]
    assert got == case["greedy_ids"].tolist()


@pytest.mark.parametrize("name", TEXT_CASES)
def test_prefill_and_decode_logits_within_tolerance(loaded, reference, name):
    from mlx_lm.models.cache import make_prompt_cache

    model, _, _ = loaded
    case = reference(name)
    cache = make_prompt_cache(model)
    logits = model(mx.array(case["input_ids"]), cache=cache)[0]
    assert np.abs(np.array(logits) - case["prefill_logits"]).max() < TOL
    rows = [np.array(logits[-1])]
    for token in case["greedy_ids"][:-1]:
        rows.append(np.array(model(mx.array([[int(token)]]), cache=cache)[0, -1]))
    assert np.abs(np.stack(rows) - case["greedy_logits"]).max() < TOL


def test_generate_from_the_rendered_prompt_string(loaded, reference):
    """What a host does: the chat-template string in, mlx-lm tokenizes it (no second BOS)."""
    model, tokenizer, _ = loaded
    case = reference("text_medium")
    prompt = case["meta"]["prompt"]
    steps = len(case["greedy_ids"])
    tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=steps)]
    assert tokens == case["greedy_ids"].tolist()
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=steps)
    want = tokenizer.decode(case["greedy_ids"].tolist())
    # mlx-lm's BPE streaming detokenizer drops the first output's leading space (every BPE model).
    assert text == (want[1:] if want.startswith(" ") else want)


# ------------------------------------------------------------- image path


def test_mlx_vlm_image_path_unchanged_while_registered(registered, reference, tiny_ckpt_original):
    from mlx_vlm.utils import load_model

    model = load_model(tiny_ckpt_original)
    assert is_vendored_file(sys.modules[type(model).__module__].__file__)
    case = reference("img_448")
    assert greedy(model, case, len(case["greedy_ids"])) == case["greedy_ids"].tolist()


def test_decoding_an_image_prompt_with_the_mlx_lm_model_is_wrong(loaded, reference, tmp_path):
    """Why registration is opt-in: what a host that decodes with an mlx-lm model after an
    mlx-vlm image prefill (oMLX's old "decode model") computes. On the prefill's own cache
    objects the delta travels with the cache and the decode is right; from mlx-lm's prompt-cache
    file of that cache (state only) it rotates from the offset alone and is wrong."""
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
    from mlx_vlm.utils import load_model

    lm, _, path = loaded
    vlm = load_model(path)
    case = reference("img_448")
    assert int(np.asarray(case["rope_deltas"]).reshape(-1)[0]) != 0
    steps = 8

    def decode(step_model, reload: bool = False) -> np.ndarray:
        cache = make_prompt_cache(lm)
        rows = [np.array(prefill(vlm, case, cache)[-1])]
        if reload:
            save_prompt_cache(str(tmp_path / "prompt.safetensors"), cache)
            cache = load_prompt_cache(str(tmp_path / "prompt.safetensors"))
            step_model.language_model._rope_deltas = None  # as an mlx-lm model that never saw a prefill
        for token in case["greedy_ids"][: steps - 1]:
            out = step_model(mx.array([[int(token)]]), cache=cache)
            rows.append(np.array(getattr(out, "logits", out)[0, -1]))
        return np.stack(rows)

    ref = case["greedy_logits"][:steps]
    assert np.abs(decode(vlm.language_model) - ref).max() < TOL  # honours the delta the prefill kept
    assert np.abs(decode(lm) - ref).max() < TOL  # the same cache objects carry it
    wrong = decode(lm, reload=True)  # a cache rebuilt from its state rotates from the offset alone
    assert np.abs(wrong[1:] - ref[1:]).max() > 100 * TOL


# ----------------------------------------------------------- undo / refusal


def test_remove_patch_undoes_the_registration(registered, tiny_ckpt_original):
    saved = {n: m for n, m in sys.modules.items() if n == PACKAGE or n.startswith(PACKAGE + ".")}
    mlx_lm.load(str(tiny_ckpt_original))
    assert LM_PACKAGE in sys.modules
    try:
        assert remove_patch() is True
        assert lm_path_entries() == []
        assert LM_PACKAGE not in sys.modules
        assert "cohere_compass" not in vars(mlx_lm.models)
        with pytest.raises(ValueError, match="cohere_compass not supported"):
            mlx_lm.load(str(tiny_ckpt_original))
    finally:
        restore_session_patch(saved)
        apply_patch(mlx_lm=True)
    assert len(lm_path_entries()) == 1


def test_refused_while_upstream_is_live():
    if vendored_live():
        pytest.skip("the vendored cohere_compass is live on this pin (registration allowed)")
    before = list(mlx_lm.models.__path__)
    with pytest.raises(CompassCompatError, match="COMPASS_COMPAT_IMPLEMENTATION=vendored"):
        apply_patch(mlx_lm=True)
    assert list(mlx_lm.models.__path__) == before
    assert compass_compat.implementation_info().patched
