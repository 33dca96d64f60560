"""Quantization modes beyond affine 4/8: affine 5/6-bit, MXFP4, MXFP8, NVFP4, on every pin.

Fixtures are made at test time from the tiny checkpoint (MLX layout) with this pin's own
``mx.quantize``: every 2-D text weight whose input size divides by the group, as mlx-vlm's
converter picks them (the vision tower stays float32). A mode either loads and matches the
unquantized model holding ``mx.dequantize`` of the same weights (in the dtype it returns:
float32 for affine, bfloat16 for the fp modes, whose ``QuantizedEmbedding`` lookups are
bfloat16 too, so the fp-mode model's activations are bfloat16), or is refused by the checkpoint
checks before mlx-vlm's loader reads anything, with an error naming the mode and the pin.

Which pins refuse what was measured (mlx-vlm, mlx): 0.3.9's ``load_model`` calls
``nn.quantize`` without ``mode`` (the folder then fails with "Missing N parameters ...
biases"); mlx 0.30.0's CPU ``quantized_matmul`` disagrees with ``mx.dequantize`` for mxfp8 and
nvfp4 (test_mlx_kernels_agree_with_dequantize shows both facts on the pin that has them).
"""

from __future__ import annotations

import json
import pathlib
import shutil
from importlib.metadata import version

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from _mlx import answer_ids, chat_prompt, load
from _quant import quantize_folder
from vendored import vendored

vendored()

MODES = {  # fixture name: (mode, group_size, bits)
    "affine5": ("affine", 64, 5),
    "affine6": ("affine", 64, 6),
    "mxfp4": ("mxfp4", 32, 4),
    "mxfp8": ("mxfp8", 32, 8),
    "nvfp4": ("nvfp4", 16, 4),
}
# Measured per (mlx-vlm, mlx): the modes that cannot load. Every other pin loads all of them.
REFUSED = {("0.3.9", "0.30.0"): {"mxfp4", "mxfp8", "nvfp4"}}
BROKEN_KERNELS = {"0.30.0": {"mxfp8", "nvfp4"}}  # mlx versions whose CPU matmul is wrong
# Max |quantized - dequantized| logits: 0 measured for every mode on every pin that loads it
# (logit range ~20); the margin allows another accumulation order in a future mlx.
TOL = 1e-4
PIN = (version("mlx-vlm"), version("mlx"))
PROMPT = "Describe the image."


def refused(name: str) -> bool:
    return name in REFUSED.get(PIN, set())


def dequantize_folder(quantized: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The same model unquantized: mx.dequantize of every quantized weight, with its mode."""
    shutil.copytree(quantized, out)
    config = json.loads((quantized / "config.json").read_text())
    q = config.pop("quantization")
    weights = mx.load(str(quantized / "model.safetensors"))
    dense = {}
    for key, w in weights.items():
        prefix = key[: -len(".weight")]
        if key.endswith((".scales", ".biases")):
            continue
        if f"{prefix}.scales" in weights:
            # In mx.dequantize's own dtype: bfloat16 for the fp modes, as QuantizedEmbedding's
            # lookup returns, so both models carry the same activation dtype.
            w = mx.dequantize(
                w,
                weights[f"{prefix}.scales"],
                weights.get(f"{prefix}.biases"),
                group_size=q["group_size"],
                bits=q["bits"],
                mode=q["mode"],
            )
        dense[key] = w
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), dense, metadata={"format": "mlx"})
    return out


@pytest.fixture(scope="module")
def folders(tiny_ckpt_mlx, tmp_path_factory):
    """{name: (quantized folder, dequantized folder)}."""
    out = {}
    for name, (mode, group, bits) in MODES.items():
        root = tmp_path_factory.mktemp(name)
        q = quantize_folder(tiny_ckpt_mlx, root / "q", mode, group, bits)
        out[name] = (q, dequantize_folder(q, root / "dense"))
    return out


def prompt(processor, model, image) -> str:
    return chat_prompt((model, processor), PROMPT, 1 if image else 0)


def prefill_logits(path: pathlib.Path, image) -> np.ndarray:
    model, processor = load(str(path))
    inputs = processor(
        text=prompt(processor, model, image), images=[str(image)] if image else None, return_tensors="np"
    )
    kwargs = {k: mx.array(inputs[k]) for k in ("image_grid_thw", "mm_token_type_ids") if k in inputs}
    pixels = mx.array(inputs["pixel_values"]) if image else None
    out = model(mx.array(inputs["input_ids"]), pixels, cache=model.language_model.make_cache(), **kwargs)
    return np.array(out.logits[0].astype(mx.float32))


def greedy_tokens(path: pathlib.Path, image, max_tokens: int = 8):
    return answer_ids(path, PROMPT, image, max_tokens)


@pytest.mark.parametrize("name", sorted(MODES))
def test_mlx_kernels_agree_with_dequantize(name):
    """The measured fact behind the mlx part of the rule, on this pin's mlx."""
    mode, group, bits = MODES[name]
    w = mx.random.normal((64, 256), key=mx.random.key(0))
    x = mx.random.normal((3, 256), key=mx.random.key(1))
    q = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    biases = q[2] if mode == "affine" else None
    got = mx.quantized_matmul(x, q[0], q[1], biases, transpose=True, group_size=group, bits=bits, mode=mode)
    want = x @ mx.dequantize(q[0], q[1], biases, group_size=group, bits=bits, mode=mode).T
    diff = mx.abs(got - want).max().item()
    if name in BROKEN_KERNELS.get(PIN[1], set()):
        assert diff > 1.0, f"mlx {PIN[1]} {name}: kernels now agree ({diff:.3g}); drop the refusal"
    else:
        assert diff < 1e-4, f"mlx {PIN[1]} {name}: quantized_matmul vs dequantize differ by {diff:.3g}"


@pytest.mark.parametrize("name", sorted(MODES))
def test_mode_loads_and_matches_dequantized(folders, fixture_images, name):
    if refused(name):
        pytest.skip(f"{name} is refused on mlx-vlm {PIN[0]} / mlx {PIN[1]} (test_mode_is_refused_up_front)")
    mode, group, bits = MODES[name]
    quantized, dense = folders[name]
    model, _ = load(str(quantized))
    for layer in (model.language_model.model.embed_tokens, model.language_model.model.layers[0].mlp.down_proj):
        assert isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        assert (layer.group_size, layer.bits, getattr(layer, "mode", "affine")) == (group, bits, mode)
    assert type(model.vision_tower.blocks[0].attn.qkv) is nn.Linear
    for image in (None, fixture_images["synth_320x256.png"]):
        got, want = prefill_logits(quantized, image), prefill_logits(dense, image)
        diff = float(np.abs(got - want).max())
        print(
            f"\n[quant modes] {name} {'image' if image else 'text'}: max|q - dequantized| = {diff:.3g} "
            f"(logit range {np.ptp(want):.3g}), mlx-vlm {PIN[0]}, mlx {PIN[1]}"
        )
        assert diff <= TOL, f"{name}: quantized vs dequantized logits differ by {diff:.3g}"
        assert greedy_tokens(quantized, image) == greedy_tokens(dense, image)


@pytest.mark.parametrize("name", sorted(MODES))
def test_mode_is_refused_up_front(folders, monkeypatch, name):
    if not refused(name):
        pytest.skip(f"{name} loads on mlx-vlm {PIN[0]} / mlx {PIN[1]} (test_mode_loads_and_matches_dequantized)")
    import mlx_vlm
    import mlx_vlm.utils

    from compass_compat.checkpoint_checks import CheckpointError

    quantized, _ = folders[name]
    original = mlx_vlm.utils.load_model.__wrapped__  # the pin's loader, without the shim's check
    # The failure the refusal replaces: affine quantization of the mode's weights.
    with pytest.raises(Exception, match=r"(?i)missing \d+ parameters|group size \d+ is not supported"):
        original(quantized)

    def loader_ran(*args, **kwargs):
        raise AssertionError("mlx-vlm's loader read the folder before the check refused it")

    monkeypatch.setattr(mlx_vlm.utils, "load_config", loader_ran)
    with pytest.raises(CheckpointError) as info:
        mlx_vlm.load(str(quantized))
    message = str(info.value)
    mode = MODES[name][0]
    assert f"mode '{mode}'" in message and f"mlx-vlm {PIN[0]}" in message and f"mlx {PIN[1]}" in message
    assert "mlx-vlm >= 0.4.4" in message and "affine conversion" in message
