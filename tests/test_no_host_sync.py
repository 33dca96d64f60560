"""A decode step of the vendored LanguageModel never synchronises with the host.

MLX builds a lazy graph; a decode step should only build it, and the caller evaluates the
result (asynchronously, in mlx-lm's loop). Any ``.item()``, ``tolist()``, ``int()``/``bool()``
of a device array, ``np.array(device_array)`` or ``mx.eval`` inside the step would stall the
pipeline once per token. ``HostSyncGuard`` fails on each of those while a step's graph is
built, and a memory witness catches evaluations that go through paths it cannot patch (the
buffer protocol, C extensions): building a lazy graph allocates no activation buffers, so any
allocation of at least one hidden-state vector means something was evaluated.

The tests show both that decoding (text, past the sliding window, and after an image prompt)
passes the guard, and that the guard catches each kind of sync when one is inserted.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import mlx.core as mx
import numpy as np
import pytest

from compass_data.tiny import tiny_config
from tests.support.host_sync import ARRAY_METHODS, NUMPY_FUNCS, HostSyncError, HostSyncGuard
from tests.support.vendored import vendored


@contextlib.contextmanager
def no_evaluation(min_bytes: int):
    """Fail if at least ``min_bytes`` of MLX buffers are allocated inside the block.

    Building a lazy graph allocates only scalar constants; evaluating any activation
    allocates its output buffer.
    """
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    yield
    grew = mx.get_peak_memory() - before
    if grew >= min_bytes:
        raise HostSyncError(
            f"{grew} bytes of MLX buffers were allocated while the decode step was only being "
            "built: something inside it was evaluated"
        )


# The guard (tests/support/host_sync.py) counts for scripts/bench/fullsize.py too; the tests below
# need the vendored model.
vendored()

# --------------------------------------------------------------------------- the model
HIDDEN = 512


@functools.lru_cache(maxsize=None)
def _config() -> dict:
    """The tiny config widened so one hidden vector (2 KiB) dwarfs graph-building scalars."""
    config = copy.deepcopy(tiny_config())
    text = config["text_config"]
    text.update(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024)
    text["rope_parameters"]["sliding_attention"]["mrope_section"] = [24, 20, 20]  # head_dim 128
    config["vision_config"]["out_hidden_size"] = HIDDEN
    return config


@pytest.fixture(scope="module")
def model():
    pkg = vendored()
    mx.random.seed(0)
    m = pkg.Model(pkg.ModelConfig.from_dict(_config()))
    mx.eval(m.parameters())
    return m


def _window() -> int:
    return _config()["text_config"]["sliding_window"]


def _text_prompt(n: int) -> mx.array:
    return mx.array(np.random.default_rng(0).integers(10, 200, size=(1, n)), dtype=mx.int32)


def _image_prompt():
    """(input_ids, pixel_values, image_grid_thw) for one 64x64 image (4 merged tokens)."""
    cfg = _config()
    grid = np.array([[1, 4, 4]], dtype=np.int32)
    vis = cfg["vision_config"]
    patch_dim = vis["in_channels"] * vis["temporal_patch_size"] * vis["patch_size"] ** 2
    pixels = np.random.default_rng(1).standard_normal((16, patch_dim)).astype(np.float32)
    ids = [5, 6, cfg["vision_start_token_id"]] + [cfg["image_token_id"]] * 4 + [cfg["vision_end_token_id"], 7, 8]
    return mx.array([ids], dtype=mx.int32), mx.array(pixels), mx.array(grid)


def decode(model, prompt_logits, cache, steps: int, guard_factory):
    """mlx-lm's loop: build step n+1 while step n is evaluated asynchronously.

    Only building the step's graph runs under ``guard_factory()``; evaluation and reading the
    token happen outside, as a host does.
    """
    y = mx.argmax(prompt_logits[:, -1], axis=-1)
    mx.async_eval(y)
    tokens = []
    for _ in range(steps):
        with guard_factory():
            logits = model.language_model(y[:, None], cache=cache).logits
        next_y = mx.argmax(logits[:, -1], axis=-1)
        mx.async_eval(next_y)
        tokens.append(y.item())
        y = next_y
    return tokens


@contextlib.contextmanager
def strict_guard():
    with HostSyncGuard("raise"), no_evaluation(HIDDEN * 4):
        yield


@contextlib.contextmanager
def no_guard():
    yield


def _prefill_text(model, n=12):
    cache = model.language_model.make_cache()
    out = model(_text_prompt(n), cache=cache)
    mx.eval(out.logits)
    return out.logits, cache


# --------------------------------------------------------------------------- decoding passes
def test_text_decode_past_the_window_makes_no_host_sync(model):
    logits, cache = _prefill_text(model)
    steps = 2 * _window()  # the rotating caches wrap at least once
    guarded = decode(model, logits, cache, steps, strict_guard)
    logits, cache = _prefill_text(model)
    assert guarded == decode(model, logits, cache, steps, no_guard)


def test_decode_after_an_image_prompt_makes_no_host_sync(model):
    ids, pixels, grid = _image_prompt()
    cache = model.language_model.make_cache()
    out = model(ids, pixel_values=pixels, image_grid_thw=grid, cache=cache)
    mx.eval(out.logits)
    # Image prompts leave a rope delta: decode positions are offset + delta, still lazy.
    assert model.language_model._rope_deltas is not None
    decode(model, out.logits, cache, 8, strict_guard)


def test_decode_through_mlx_vlm_loader_makes_no_host_sync(tiny_ckpt_mlx):
    from mlx_vlm.utils import load_model

    m = load_model(tiny_ckpt_mlx)
    cache = m.language_model.make_cache()
    out = m(_text_prompt(20), cache=cache)
    mx.eval(out.logits)
    with_guard = functools.partial(HostSyncGuard, "raise")
    decode(m, out.logits, cache, 20, with_guard)


# --------------------------------------------------------------------------- the guard works
def _inject(monkeypatch, model, action):
    """Make every decoder layer run ``action(x)`` on its input, as a careless edit would."""
    layer_cls = type(model.language_model.model.layers[0])
    original = layer_cls.__call__

    def call(self, x, *args, **kwargs):
        action(x)
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(layer_cls, "__call__", call)


INJECTED = {
    "item": lambda x: x[0, 0, 0].item(),
    "tolist": lambda x: x[0, 0, :2].tolist(),
    "int": lambda x: int(x[0, 0, 0].astype(mx.int32)),
    "bool": lambda x: bool(x.sum() > 0),
    "float": lambda x: float(x.max()),
    "np.array": lambda x: np.array(x),
    "np.asarray": lambda x: np.asarray(x[0]),
    "mx.eval": lambda x: mx.eval(x),
    "print": lambda x: print(x[0, 0, :2]),
}


@pytest.mark.parametrize("kind", sorted(INJECTED))
def test_guard_catches_an_inserted_sync(model, monkeypatch, kind):
    logits, cache = _prefill_text(model)
    _inject(monkeypatch, model, INJECTED[kind])
    with pytest.raises(HostSyncError):
        decode(model, logits, cache, 2, functools.partial(HostSyncGuard, "raise"))


def test_memory_witness_catches_a_sync_the_patches_cannot_see(model, monkeypatch):
    # memoryview() reads the buffer protocol directly: no Python attribute to patch.
    logits, cache = _prefill_text(model)
    _inject(monkeypatch, model, lambda x: memoryview(x * 2))
    decode(model, logits, cache, 2, functools.partial(HostSyncGuard, "raise"))  # patches: blind
    with pytest.raises(HostSyncError, match="allocated"):
        decode(model, logits, cache, 2, strict_guard)


def test_guard_counts_and_restores_everything():
    before = {a: getattr(mx.array, a) for a in ARRAY_METHODS if hasattr(mx.array, a)}
    np_before = {a: getattr(np, a) for a in NUMPY_FUNCS}
    eval_before = mx.eval
    x = mx.array([1.0, 2.0])
    with HostSyncGuard("count") as guard:
        x.item() if x.size == 1 else x.tolist()
        np.array(x)
        np.array([1, 2])  # a host list: not a sync, not counted
        mx.eval(x)
    assert guard.calls == {"mx.array.tolist": 1, "np.array": 1, "mx.eval": 1}
    assert {a: getattr(mx.array, a) for a in before} == before
    assert {a: getattr(np, a) for a in NUMPY_FUNCS} == np_before
    assert mx.eval is eval_before
