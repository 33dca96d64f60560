"""Quantized checkpoints: mlx-vlm's own converter through the shim, and upstream 0.7.10's output.

What gets quantized is mlx-vlm's convention, applied by its converter (no model predicate):
every text ``nn.Linear`` and the token embedding (``nn.QuantizedEmbedding``, which also
serves as the tied head through ``as_linear``), affine, group 64; the vision tower (and its
mergers) is skipped by ``mlx_vlm.utils.skip_multimodal_module`` ("vision_tower" paths) and
keeps the source dtype, as for qwen3_vl and upstream 0.7.10's own cohere_compass.

The honest check: a quantized model's logits equal, within 1e-4, those of a float32 model
whose weights are the dequantized quantized weights (an independent float32 checkpoint
loaded through mlx-vlm). The distance to the original float32 logits is reported, not
asserted tightly (it is quantization error, not a bug).
"""

from __future__ import annotations

import functools
import json
import pathlib

import mlx.core as mx
import numpy as np
import pytest

from tests.support.parity import prefill
from tests.support.recipes import dequantized_checkpoint, read_weights
from tests.support.vendored import vendored

vendored()

FIXTURE_DIR = pathlib.Path(__file__).resolve().parent / "fixtures" / "quantized_0710"
GROUP = 64
TOL = 1e-4
CASES = ["text_medium", "img_448"]  # inputs of the recorded reference cases: a text and an image prompt
TEXT_LAYERS, PROJECTIONS = (
    8,
    (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ),
)
# The modules mlx-vlm's converter must quantize in the tiny model (written out, not derived).
EXPECTED_QUANTIZED = {"language_model.model.embed_tokens"} | {
    f"language_model.model.layers.{i}.{p}" for i in range(TEXT_LAYERS) for p in PROJECTIONS
}


def convert_tiny(source: pathlib.Path, out: pathlib.Path, bits: int) -> pathlib.Path:
    from mlx_vlm.convert import convert

    convert(str(source), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=GROUP)
    return out


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    from compass_data.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_bf16"), layout="original", dtype="bfloat16")


@pytest.fixture(scope="module")
def converted(tiny_ckpt_original, tiny_bf16, tmp_path_factory):
    """This pin's own conversions: {"q4": ..., "q8": ..., "q4_bf16": ..., "q8_bf16": ...}."""
    out = {}
    for bits in (4, 8):
        out[f"q{bits}"] = convert_tiny(tiny_ckpt_original, tmp_path_factory.mktemp(f"q{bits}") / "m", bits)
        out[f"q{bits}_bf16"] = convert_tiny(tiny_bf16, tmp_path_factory.mktemp(f"q{bits}_bf16") / "m", bits)
    return out


@functools.lru_cache(maxsize=None)
def load_model(path: str):
    from mlx_vlm.utils import load_model as mlx_vlm_load_model

    return mlx_vlm_load_model(pathlib.Path(path))


@functools.lru_cache(maxsize=None)
def load(path):
    from mlx_vlm import load as mlx_vlm_load

    return mlx_vlm_load(str(path))


def quantized_prefixes(path: pathlib.Path) -> set:
    return {k[: -len(".scales")] for k in read_weights(path) if k.endswith(".scales")}


@pytest.mark.parametrize("bits", [4, 8])
def test_converter_quantizes_text_linears_and_embedding_not_vision(converted, bits):
    path = converted[f"q{bits}"]
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"]["group_size"] == GROUP and config["quantization"]["bits"] == bits
    assert config["quantization"].get("mode", "affine") == "affine"
    assert quantized_prefixes(path) == EXPECTED_QUANTIZED
    weights = read_weights(path)
    assert not any(k.startswith("vision_tower.") and k.endswith(".scales") for k in weights)
    assert weights["vision_tower.patch_embed.proj.weight"].dtype == mx.float32
    assert not any("lm_head" in k for k in weights), "the head is tied: no lm_head tensor"
    model = load_model(str(path))
    import mlx.nn as nn

    assert isinstance(model.language_model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(model.language_model.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert isinstance(model.vision_tower.blocks[0].attn.qkv, nn.Linear)  # float (on the CPU, a lane subclass)


@pytest.fixture(scope="module")
def dequantized(converted, tmp_path_factory):
    """{bits: float32 checkpoint of the dequantized q{bits} weights}."""
    return {
        bits: dequantized_checkpoint(converted[f"q{bits}"], tmp_path_factory.mktemp(f"dense{bits}") / "m", float32=True)
        for bits in (4, 8)
    }


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", CASES)
def test_quantized_logits_equal_dequantized_float32_model(
    converted, dequantized, tiny_ckpt_original, reference, bits, name
):
    case = reference(name)
    quantized = load_model(str(converted[f"q{bits}"]))
    dense = load_model(str(dequantized[bits]))
    assert not any(k.endswith(".scales") for k, _ in _flat(dense.parameters()))
    got = np.array(prefill(quantized, case))
    want = np.array(prefill(dense, case))
    diff = float(np.abs(got - want).max())
    original = np.array(prefill(load_model(str(tiny_ckpt_original)), case))
    drift = float(np.abs(got - original).max())
    agree = float(np.mean(got.argmax(-1) == original.argmax(-1)))
    print(
        f"\n[quantized] {bits}-bit {name}: max|q - dequantized fp32| = {diff:.3g}; "
        f"max|q - original fp32| = {drift:.3g} (logit range {np.ptp(original):.3g}), "
        f"argmax agreement {agree:.0%} over {got.shape[0]} positions"
    )
    assert diff <= TOL, f"{bits}-bit {name}: quantized vs dequantized float32 logits differ by {diff:.3g}"
    # Quantization error, reported above; bounded only loosely so a broken head or a lost
    # scale (errors of the size of the logits themselves) still fails.
    assert drift < (0.5 if bits == 4 else 0.1) * np.ptp(original)


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def generate_text(path, image, prompt="Describe the image.", max_tokens=8) -> str:
    from mlx_vlm import stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(str(path))
    images = [str(image)] if image else []
    formatted = apply_chat_template(processor, model.config, prompt, num_images=len(images))
    results = list(
        stream_generate(model, processor, formatted, image=images or None, max_tokens=max_tokens, temperature=0.0)
    )
    assert results and max(r.generation_tokens for r in results) == max_tokens
    return "".join(r.text for r in results)


@pytest.mark.parametrize("key", ["q4", "q8", "q4_bf16", "q8_bf16"])
def test_quantized_checkpoints_reload_and_generate(converted, fixture_images, key):
    image = fixture_images["synth_320x256.png"]
    assert generate_text(converted[key], image)
    assert generate_text(converted[key], None)


# ------------------------------------------------------- upstream mlx-vlm 0.7.10's converter


UPSTREAM = {"q4_f32": "q4", "q8_bf16": "q8_bf16"}  # fixture -> this pin's conversion of the same source


def test_upstream_fixture_is_what_scripts_make_quantized_fixture_recorded():
    for name in UPSTREAM:
        meta = json.loads((FIXTURE_DIR / name / "provenance.json").read_text())
        assert meta["versions"]["mlx-vlm"] == "0.7.10" and meta["cohere_compass_implementation"] == "upstream"
        config = json.loads((FIXTURE_DIR / name / "config.json").read_text())
        assert config["quantization"]["bits"] == meta["quantize"]["bits"]
    assert sum(p.stat().st_size for p in FIXTURE_DIR.rglob("*") if p.is_file()) < 2_000_000


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_upstream_0710_quantized_checkpoint_loads_through_the_shim(converted, reference, name):
    fixture = FIXTURE_DIR / name
    ours = converted[UPSTREAM[name]]
    upstream_weights, our_weights = read_weights(fixture), read_weights(ours)
    # Same tensors, bit for bit: upstream's converter and this pin's (through the shim) agree.
    assert set(upstream_weights) == set(our_weights)
    for key, value in upstream_weights.items():
        assert value.dtype == our_weights[key].dtype and value.shape == our_weights[key].shape, key
        assert mx.array_equal(value, our_weights[key]).item(), key
    model, mine = load_model(str(fixture)), load_model(str(ours))
    for case_name in CASES:
        case = reference(case_name)
        got, want = prefill(model, case).astype(mx.float32), prefill(mine, case).astype(mx.float32)
        np.testing.assert_array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_upstream_0710_quantized_checkpoint_generates_text_and_images(converted, fixture_images, name):
    image = fixture_images["synth_320x256.png"]
    # Its transformers-5 tokenizer files load with this pin's transformers.
    assert generate_text(FIXTURE_DIR / name, image) == generate_text(converted[UPSTREAM[name]], image)
    assert generate_text(FIXTURE_DIR / name, None) == generate_text(converted[UPSTREAM[name]], None)
