"""Quantization modes beyond affine 4/8: affine 5/6-bit, MXFP4, MXFP8, NVFP4, on every pin.

Fixtures are made at test time from the tiny checkpoint (MLX layout) with this pin's own
``mx.quantize``: every 2-D text weight whose input size divides by the group, as mlx-vlm's
converter picks them (the vision tower stays float32). A mode either loads and matches the
unquantized model holding ``mx.dequantize`` of the same weights (in the dtype it returns:
float32 for affine, bfloat16 for the fp modes, whose ``QuantizedEmbedding`` lookups are
bfloat16 too, so the fp-mode model's activations are bfloat16), or is refused by the checkpoint
checks before mlx-vlm's loader reads anything, with an error naming the mode, the pin and what
the probe measured.

What is refused is decided by the loader probe of the running install (compass_compat/probes.py),
not by version numbers: does mlx-vlm's load_model pass the mode to ``mlx.nn.quantize``? Its verdict
is checked here against real loads, against the version threshold it replaced (on the matrix
stacks where that was measured), and against monkeypatched loaders that are wrong or right on purpose.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
from importlib.metadata import version

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from compass_compat import probes
from compass_compat.checkpoint_checks import CheckpointError, validate_checkpoint
from tests.support.mlx_vlm_run import answer_ids, chat_prompt, load
from tests.support.quantize import quantize_folder
from tests.support.vendored import vendored

vendored()

MODES = {  # fixture name: (mode, group_size, bits)
    "affine5": ("affine", 64, 5),
    "affine6": ("affine", 64, 6),
    "mxfp4": ("mxfp4", 32, 4),
    "mxfp8": ("mxfp8", 32, 8),
    "nvfp4": ("nvfp4", 16, 4),
}
FP_MODES = sorted(name for name, (mode, _, _) in MODES.items() if mode != "affine")
# Max |quantized - dequantized| logits: 0 measured for every mode on every pin that loads it
# (logit range ~20); the margin allows another accumulation order in a future mlx.
TOL = 1e-4
PIN = (version("mlx-vlm"), version("mlx"))
PROMPT = "Describe the image."
REPO = pathlib.Path(__file__).resolve().parents[1]

# The version threshold the loader probe replaced, measured on the matrix's stacks only: mlx-vlm
# 0.3.9's loader drops the mode (0.4.4's passes it). Kept as data, to check the probe's verdicts there.
OLD_MIN_MLX_VLM = (0, 4, 4)


def _version_tuple(text: str):
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def matrix_stacks() -> set:
    """(mlx-vlm, mlx) of every matrix environment, from the committed scripts/constraints records."""
    stacks = set()
    for path in (REPO / "scripts" / "env" / "constraints").glob("mlxvlm-*.txt"):
        pins = dict(re.findall(r"^(mlx-vlm|mlx)==([^\s#]+)", path.read_text(), re.M))
        if "mlx-vlm" in pins and "mlx" in pins:
            stacks.add((pins["mlx-vlm"], pins["mlx"]))
    return stacks


def refused(name: str) -> bool:
    """Whether the checkpoint checks refuse this mode here: what the loader probe measured."""
    mode, group, bits = MODES[name]
    return mode != "affine" and probes.loader_passes_mode(mode, group, bits).broken


@pytest.fixture
def fresh_probes():
    """Probes measure again inside the test and forget what a monkeypatched run measured."""
    probes.loader_passes_mode.cache_clear()
    yield
    probes.loader_passes_mode.cache_clear()


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


@pytest.mark.parametrize("name", FP_MODES)
def test_probe_verdict_equals_the_old_threshold_on_the_matrix(name):
    """On every matrix stack (where the threshold was measured), probe and threshold agree."""
    mode, group, bits = MODES[name]
    loader = probes.loader_passes_mode(mode, group, bits)
    if PIN not in matrix_stacks():
        pytest.skip(
            f"mlx-vlm {PIN[0]} with mlx {PIN[1]} is no matrix stack (no threshold was measured here); "
            f"the probe says: {loader.evidence}"
        )
    old_loader_refuses = _version_tuple(PIN[0]) < OLD_MIN_MLX_VLM
    print(f"\n[quant probe] {PIN}: {loader.evidence}")
    assert loader.broken == old_loader_refuses, loader.evidence
    assert refused(name) == old_loader_refuses


def test_probes_run_once_per_process(fresh_probes, monkeypatch):
    first = probes.loader_passes_mode("mxfp4", 32, 4)

    def measured_again(*args, **kwargs):
        raise AssertionError("a cached probe measured again")

    monkeypatch.setattr(mx, "save_safetensors", measured_again)
    assert probes.loader_passes_mode("mxfp4", 32, 4) == first


def _fake_loader(passes_mode: bool, quantizes: bool = True):
    def load_model(model_path, *args, **kwargs):
        q = json.loads((pathlib.Path(model_path) / "config.json").read_text())["quantization"]
        if quantizes:
            extra = {"mode": q["mode"]} if passes_mode else {}
            nn.quantize(nn.Linear(64, 64), group_size=q["group_size"], bits=q["bits"], **extra)
        raise RuntimeError("a fake loader stops here")

    return load_model


def test_loader_that_drops_the_mode_is_caught_and_one_that_passes_it_let_through(folders, fresh_probes, monkeypatch):
    import mlx_vlm.utils

    mode, group, bits = MODES["mxfp4"]
    quantized, _ = folders["mxfp4"]
    monkeypatch.setattr(mlx_vlm.utils, "load_model", _fake_loader(passes_mode=False))
    probe = probes.loader_passes_mode(mode, group, bits)
    assert probe.ok is False and "mode='<no mode keyword>'" in probe.evidence, probe.evidence
    with pytest.raises(CheckpointError, match="loader quantizes the model without the mode"):
        validate_checkpoint(quantized)

    for fake, want in ((_fake_loader(passes_mode=True), True), (_fake_loader(True, quantizes=False), None)):
        probes.loader_passes_mode.cache_clear()
        monkeypatch.setattr(mlx_vlm.utils, "load_model", fake)
        probe = probes.loader_passes_mode(mode, group, bits)
        assert probe.ok is want, probe.evidence  # None: never saw quantize, so refuses nothing
        validate_checkpoint(quantized)


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
    assert isinstance(model.vision_tower.blocks[0].attn.qkv, nn.Linear)  # the tower stays unquantized
    for image in (None, fixture_images["synth_320x256.png"]):
        got, want = prefill_logits(quantized, image), prefill_logits(dense, image)
        diff = float(np.abs(got - want).max())
        print(
            f"\n[quant modes] {name} {'image' if image else 'text'}: max|q - dequantized| = {diff:.3g} "
            f"(logit range {np.ptp(want):.3g}), mlx-vlm {PIN[0]}, mlx {PIN[1]}"
        )
        assert diff <= TOL, f"{name}: quantized vs dequantized logits differ by {diff:.3g}"
        assert greedy_tokens(quantized, image) == greedy_tokens(dense, image)


def test_float32_rule_is_for_the_decoders_fp_mode_layers_on_the_cpu_only(folders, monkeypatch):
    """The loader guard's rule (MLX's CPU fp-mode kernel is ~1% off with bfloat16 inputs, so the
    test above fails without it): fp-mode layers on the CPU get it, affine ones and other devices not."""
    from mlx_vlm.utils import load_model

    def rule_on(model):
        return [n for n, m in model.language_model.named_modules() if type(m).__module__ == "compass_compat._patch"]

    if refused("mxfp4"):
        pytest.skip(f"mxfp4 is refused on mlx-vlm {PIN[0]} / mlx {PIN[1]}")
    model = load_model(folders["mxfp4"][0])
    assert "model.embed_tokens" in rule_on(model) and "model.layers.0.mlp.down_proj" in rule_on(model)
    assert rule_on(load_model(folders["affine5"][0])) == []
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    model = load_model(folders["mxfp4"][0])
    monkeypatch.undo()
    assert rule_on(model) == []


@pytest.mark.parametrize("name", sorted(MODES))
def test_mode_is_refused_up_front(folders, monkeypatch, name):
    if not refused(name):
        pytest.skip(f"{name} loads on mlx-vlm {PIN[0]} / mlx {PIN[1]} (test_mode_loads_and_matches_dequantized)")
    import mlx_vlm
    import mlx_vlm.utils

    mode, group, bits = MODES[name]
    loader = probes.loader_passes_mode(mode, group, bits)
    quantized, _ = folders[name]
    original = mlx_vlm.utils.load_model.__wrapped__  # the pin's loader, without the shim's check
    # The failure the refusal replaces: affine layers for the mode's weights.
    with pytest.raises(Exception, match=r"(?i)missing \d+ parameters|group size \d+ is not supported"):
        original(quantized)

    def loader_ran(*args, **kwargs):
        raise AssertionError("mlx-vlm's loader read the folder before the check refused it")

    monkeypatch.setattr(mlx_vlm.utils, "load_config", loader_ran)
    with pytest.raises(CheckpointError) as info:
        mlx_vlm.load(str(quantized))
    message = str(info.value)
    assert f"mode '{mode}'" in message and f"mlx-vlm {PIN[0]}" in message and f"mlx {PIN[1]}" in message
    assert "measured:" in message and "affine conversion" in message
    assert loader.evidence in message
