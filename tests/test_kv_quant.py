"""KV-cache quantization through mlx-vlm's own generate (``kv_bits``, ``kv_quant_scheme``,
``quantized_kv_start=0``: the quantized cache live from the first decoded token) and server.

Sliding-window layers keep their float rotating cache (bounded by the window; mlx-vlm has no
quantized rotating cache); full-attention layers take the pin's quantized cache and attend
through the pin's ``models.base.scaled_dot_product_attention``. Expected answers are
transformers' recorded greedy answers (tests/fixtures/toy_reference.json, float).

What MLX cannot do: uniform KV quantization groups a key's ``head_dim`` in groups of 32, 64 or
128. The default checkpoint has head_dim 64: mlx-vlm's default ``kv_group_size`` (64) runs, and
so does 32. The tiny one has 16, which no group fits: refused by name
(``KVCacheQuantizationError``), as is a group larger than head_dim (64 on a tiny checkpoint read
as head_dim 32, 128 on the default one). Uniform 8 and 4 bits also run on that head_dim-32
checkpoint (the tiny tensors, two heads), whose random weights give near-tied logits, so only
what must hold is asserted there: the run completes with finite log-probabilities. Figures
against float: docs/features.md.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import pathlib
from typing import Dict, List

import mlx.core as mx
import pytest

from compass_data import tiny, toy
from tests.support import mlx_vlm_run
from tests.support.vendored import vendored

vendored()

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = json.loads((ROOT / "tests" / "fixtures" / "toy_reference.json").read_text())
DEMO = ROOT / "compass_compat" / "assets" / "demo.png"
TURBOQUANT = importlib.util.find_spec("mlx_vlm.turboquant") is not None
needs_turboquant = pytest.mark.skipif(not TURBOQUANT, reason="this mlx-vlm has no TurboQuant (mlx_vlm.turboquant)")


def _generate_step():
    import importlib

    return importlib.import_module("mlx_vlm.generate").generate_step


def _stream(loaded, text: str, images: List[str], max_tokens: int, **kwargs) -> Dict[str, object]:
    """Greedy ids and whether every step's log-probabilities were finite, via stream_generate."""
    # Not cases.stream_ids: this reads each step's log-probabilities as well as its token.
    from mlx_vlm import stream_generate

    prompt = mlx_vlm_run.chat_prompt(loaded, text, len(images))
    ids: Dict[int, int] = {}
    finite = True
    for result in stream_generate(
        *loaded, prompt, image=images or None, max_tokens=max_tokens, temperature=0.0, **kwargs
    ):
        ids.setdefault(int(result.generation_tokens), int(result.token))
        finite = finite and bool(mx.all(mx.isfinite(result.logprobs)).item())
    return {"ids": [ids[k] for k in sorted(ids)], "finite": finite}


def _answer(loaded, ids: List[int]) -> str:
    return loaded[1].tokenizer.decode(ids, skip_special_tokens=True).strip()


@pytest.fixture(scope="module")
def default_loaded():
    return mlx_vlm_run.load(str(toy.ensure_default_checkpoint()))


@pytest.fixture(scope="module")
def head_dim_32(tmp_path_factory) -> pathlib.Path:
    """The tiny checkpoint's tensors read as two heads of 32 (one KV head): MLX can group it."""
    config = tiny.tiny_config()
    config["text_config"].update(num_attention_heads=2, num_key_value_heads=1)
    config["text_config"]["rope_parameters"]["sliding_attention"]["mrope_section"] = [8, 4, 4]
    return tiny.write_checkpoint(tmp_path_factory.mktemp("head_dim_32"), config, tiny.tiny_weights())


def test_sliding_layers_keep_float_cache_full_layers_quantize(default_loaded):
    model = default_loaded[0]
    caches = model.language_model.make_cache()
    kinds = [layer.layer_type for layer in model.language_model.model.layers]
    converted = [c.to_quantized(group_size=64, bits=8) for c in caches]
    for kind, before, after in zip(kinds, caches, converted):
        if kind == "sliding_attention":
            assert after is before
        else:
            assert after is not before and after.bits == 8 and after.group_size == 64


def _reference_cases():
    """The text prompts and the demo's worded questions, with transformers' greedy answers. Box
    digits are near-ties that any quantization may move: docs/features.md counts them."""
    cases = [(c["prompt"], [], c["text"]) for c in REFERENCE["text_only"]]
    cases += [
        (REFERENCE["demo"][k]["prompt"], [str(DEMO)], REFERENCE["demo"][k]["text"])
        for k in ("describe", "count", "colour")
    ]
    return cases


def _answers_as_reference(loaded, **kv) -> None:
    for text, images, expected in _reference_cases():
        got = _stream(loaded, text, images, REFERENCE["max_new_tokens"], quantized_kv_start=0, **kv)
        assert got["finite"], text
        assert _answer(loaded, got["ids"]) == expected, (text, kv)


@needs_turboquant
@pytest.mark.parametrize("bits", [3.5, 3])
def test_turboquant_default_checkpoint_answers_as_reference(default_loaded, bits):
    _answers_as_reference(default_loaded, kv_bits=bits, kv_quant_scheme="turboquant")


def test_uniform_8_bit_default_checkpoint_answers_as_reference(default_loaded):
    """8-bit keys and values at mlx-vlm's default kv_group_size (64, the toy's head_dim; none
    passed) from the first token: every text prompt and demo question answers as transformers'
    float greedy answer."""
    _answers_as_reference(default_loaded, kv_bits=8)


def test_uniform_8_bit_group_32_default_checkpoint_answers_as_reference(default_loaded):
    """Group 32 (two groups per key of 64) answers as transformers too."""
    _answers_as_reference(default_loaded, kv_bits=8, kv_group_size=32)


needs_quantized_kv_start = pytest.mark.skipif(
    "quantized_kv_start" not in inspect.signature(_generate_step()).parameters,
    reason="this mlx-vlm's generate_step has no quantized_kv_start",
)


def _first_step_error(loaded, **kwargs) -> Exception:
    model, processor = loaded
    prompt = mlx_vlm_run.chat_prompt(loaded, "Say hello.", 0)
    ids = mx.array([processor.tokenizer.encode(prompt, add_special_tokens=False)])
    steps = _generate_step()(ids, model, None, None, kv_bits=8, quantized_kv_start=0, **kwargs)
    with pytest.raises(ValueError) as caught:
        next(steps)
    return caught.value


@needs_quantized_kv_start
@pytest.mark.parametrize("group", [32, 64])
def test_uniform_on_head_dim_16_is_refused_by_name(tiny_ckpt_original, group):
    """MLX groups keys in 32, 64 or 128 along head_dim; 16 cannot be grouped: a named error that
    says what does run, from the first conversion (a sliding layer's, before the full-attention
    layer's mx.quantize fails with a message naming no setting), never a silent float cache."""
    error = _first_step_error(mlx_vlm_run.load(str(tiny_ckpt_original)), kv_group_size=group)
    assert type(error) is vendored("language").KVCacheQuantizationError
    assert "head_dim 16" in str(error) and "turboquant" in str(error)


@needs_quantized_kv_start
def test_uniform_group_larger_than_head_dim_names_the_group_that_fits(head_dim_32):
    """mlx-vlm's default kv_group_size (64) on head_dim 32: the error names kv_group_size=32."""
    error = _first_step_error(mlx_vlm_run.load(str(head_dim_32)), kv_group_size=64)
    assert type(error) is vendored("language").KVCacheQuantizationError
    assert "kv_group_size=32" in str(error)


@needs_quantized_kv_start
def test_uniform_group_128_on_the_default_checkpoint_names_kv_group_size_64(default_loaded):
    """kv_group_size 128 is larger than the toy's head_dim (64): refused by name, naming 64."""
    error = _first_step_error(default_loaded, kv_group_size=128)
    assert type(error) is vendored("language").KVCacheQuantizationError
    assert "kv_group_size=64" in str(error) and "head_dim 64" in str(error)


def test_a_quantized_cache_a_host_builds_is_refused_by_name(tiny_ckpt_original):
    """A host that hands the model quantized caches of its own (no conversion by generate):
    the same named error, from the first full-attention layer."""
    import importlib

    quantized = getattr(importlib.import_module("mlx_vlm.models.cache"), "QuantizedKVCache", None)
    if quantized is None:
        quantized = importlib.import_module("mlx_lm.models.cache").QuantizedKVCache
    model, _ = mlx_vlm_run.load(str(tiny_ckpt_original))
    caches = [
        c if c.__class__.__name__ == "RotatingKVCache" else quantized(group_size=64, bits=8)
        for c in model.language_model.make_cache()
    ]
    with pytest.raises(vendored("language").KVCacheQuantizationError, match="head_dim 16"):
        mx.eval(model.language_model(mx.array([[5, 6, 7]]), cache=caches).logits)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("case", ["text", "picture", "chunked"])
def test_uniform_head_dim_32_runs(head_dim_32, bits, case):
    loaded = mlx_vlm_run.load(str(head_dim_32))
    images = [str(DEMO)] if case == "picture" else []
    extra = {"prefill_step_size": 7} if case == "chunked" else {}
    got = _stream(
        loaded,
        "What can you do? Tell me about shapes.",
        images,
        16,
        kv_bits=bits,
        kv_group_size=32,
        quantized_kv_start=0,
        **extra,
    )
    assert got["finite"] and len(got["ids"]) == 16


def _server_flags() -> List[str]:
    from mlx_vlm import server

    path = pathlib.Path(server.__file__)
    files = [path] if path.name != "__init__.py" else sorted(path.parent.glob("*.py"))
    text = "".join(f.read_text() for f in files)
    flags = ("--kv-bits", "--kv-group-size", "--kv-quant-scheme", "--quantized-kv-start")
    return [flag for flag in flags if f'"{flag}"' in text]


SERVER_SETTINGS = {
    "turboquant 3.5": ["--kv-bits", "3.5", "--kv-quant-scheme", "turboquant"],
    "uniform 8": ["--kv-bits", "8"],  # mlx-vlm's default --kv-group-size (64)
    "uniform 8 group 32": ["--kv-bits", "8", "--kv-group-size", "32"],
}


@pytest.mark.parametrize("setting", sorted(SERVER_SETTINGS))
def test_server_kv_bits_one_request(tmp_path, setting):
    from tests.support.server import Server, reply_text

    args = SERVER_SETTINGS[setting] + ["--quantized-kv-start", "0"]
    missing = [a for a in args if a.startswith("--") and a not in _server_flags()]
    if missing:
        pytest.skip(f"this mlx-vlm's server has no {', '.join(missing)}")
    if "turboquant" in args and not TURBOQUANT:
        pytest.skip("this mlx-vlm has no TurboQuant (mlx_vlm.turboquant)")
    case = REFERENCE["text_only"][2]
    with Server(toy.ensure_default_checkpoint(), tmp_path / "server.log", *args) as server:
        status, body = server.post([{"type": "text", "text": case["prompt"]}], max_tokens=REFERENCE["max_new_tokens"])
    assert status == 200, (body, server.tail())
    assert reply_text(body).strip() == case["expected"], server.tail()
