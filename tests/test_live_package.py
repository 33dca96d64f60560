"""The live ``mlx_vlm.models.cohere_compass``, whichever it is, against the reference: CHECKLIST.md's items.

These tests drive the package only through mlx-vlm's own entry points (``mlx_vlm.load``,
``Model.__call__``, ``generate_step``, ``stream_generate``, the processor ``mlx_vlm.load`` built),
so they measure upstream's package as well as ours. The implementation under test is
upstream's with ``COMPASS_COMPAT_IMPLEMENTATION=upstream`` (on a release without one its tests
FAIL, saying so) and otherwise the one the documented rule makes live (tests/support/vendored.py
``implementation_under_test``). None of them skips for the implementation: a skip would measure
nothing. Each carries ``@pytest.mark.checklist(N)``; the pin-bump job runs them with each
implementation live and reduces the outcomes to the item verdicts (tests/support/checklist.py).

Items 5 and 6 run in fresh interpreters (tests/support/probes): for upstream one that never imports
compass_compat, as a host without the shim sees mlx-vlm.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import pytest

from compass_compat.vendor import vendor_root, within
from compass_data.tiny import build_tiny_checkpoint
from tests.support import live
from tests.support.cases import N_GREEDY, case_inputs, max_abs
from tests.support.recorded import FIXTURES, VIDEO_INDEX, VIDEO_MODEL_DIR, ReferenceFixtures
from tests.support.vendored import PACKAGE, implementation_under_test, upstream_ships

KIND = implementation_under_test()
IMAGES = FIXTURES / "images"
INDEX = ReferenceFixtures().index["cases"]
TEXT_CASES = [name for name, meta in INDEX.items() if meta["kind"] == "text"]
IMAGE_CASES = [name for name, meta in INDEX.items() if meta["kind"] == "image"]
VIDEO_CASES = VIDEO_INDEX["checkpoints"]["tiny"]
PROBES = Path(__file__).resolve().parent / "support" / "probes"
PROBE_TIMEOUT = 600


def image_paths(name: str) -> List[str]:
    return [str(IMAGES / image) for image in INDEX[name].get("images", [])]


@pytest.fixture(scope="module")
def package() -> str:
    live.require_package(KIND)
    return KIND


@pytest.fixture(scope="module")
def original(package, tiny_ckpt_original) -> Tuple[Any, Any]:
    """(model, processor) of the tiny checkpoint, original layout, through ``mlx_vlm.load``."""
    return live.load(tiny_ckpt_original, package)


# ------------------------------------------------------------------ item 1


@pytest.mark.checklist(1)
def test_the_package_is_the_implementation_under_test(package):
    """Upstream's package exists beside (not inside) the vendored tree and is the live one; or ours is."""
    where = live.live_package_dir()
    assert within(str(where), vendor_root()) == (package == "vendored"), f"{PACKAGE} is {where}, not {package}'s"
    if package == "upstream":
        assert upstream_ships()


# -------------------------------------------------------------- items 2 and 3


@pytest.mark.checklist(2)
@pytest.mark.parametrize("name", TEXT_CASES)
def test_text_case_matches_the_reference(original, reference, tiny_ckpt_original, name):
    """Prefill logits (1e-4) and ``generate_step`` greedy ids on the reference ids; through
    ``stream_generate`` on the case's prompt the ids fed (one BOS) and the 32 streamed ids."""
    model, processor = original
    problems = live.case_problems(model, processor, reference(name), [], live.eos_id(tiny_ckpt_original))
    assert not problems, f"{name}: " + "; ".join(problems)


@pytest.mark.checklist(3)
@pytest.mark.parametrize("name", IMAGE_CASES)
def test_image_case_matches_the_reference(original, reference, tiny_ckpt_original, name):
    """As the text cases, plus positions and rope delta, and through ``stream_generate`` the image
    tokens, grid and pixel values (1e-5) the processor handed the model."""
    model, processor = original
    problems = live.case_problems(model, processor, reference(name), image_paths(name), live.eos_id(tiny_ckpt_original))
    assert not problems, f"{name}: " + "; ".join(problems)


@pytest.fixture(scope="module")
def solid_image(tmp_path_factory) -> Path:
    from PIL import Image

    path = tmp_path_factory.mktemp("solid") / "solid_64x64.png"
    Image.new("RGB", (64, 64), live.SOLID_COLOUR).save(path)
    return path


@pytest.mark.checklist(3)
def test_the_image_files_are_honoured(package, tmp_path_factory, solid_image):
    """The ``small_max_pixels`` checkpoint (tokenizer_config.json min 16384 / max 65536 pixels over the
    published preprocessor_config.json, non-default mean/std): a solid 64x64 image comes out as the
    grid [1, 8, 8] with every value (v/255 - mean)/std of the file, the 640x480 image as [1, 12, 18]."""
    folder = build_tiny_checkpoint(tmp_path_factory.mktemp("small_max_pixels"), variant="small_max_pixels")
    want = live.image_files_expectations(folder)
    assert want["grids"] == {"solid 64x64": [1, 8, 8], "640x480": [1, 12, 18]}  # the files' exact arithmetic
    model, processor = live.load(folder, package)
    images = {"solid 64x64": solid_image, "640x480": IMAGES / "synth_640x480.png"}
    problems = live.image_files_problems(model, processor, folder, images, INDEX[IMAGE_CASES[0]]["prompt"])
    assert not problems, "image files not honoured: " + "; ".join(problems)


# ------------------------------------------------------------------ item 4


def replay_probe(model: Any, reference, name: str) -> str:
    """Without ``encode_image``: replay the vision tower's output through ``cached_image_features`` as a
    host would have to, and say how far the logits move (the evidence of the failure)."""
    ids, pixels, extra = case_inputs(reference(name))
    try:
        tower = model.vision_tower(
            pixels.astype(model.vision_tower.patch_embed.proj.weight.dtype), extra["image_grid_thw"]
        )
        features = tower[0] if isinstance(tower, (tuple, list)) else tower
        uncached = live.prefill_logits(model, ids, pixels, extra)
        replay = live.prefill_logits(model, ids, pixels, dict(extra, cached_image_features=features))
        return f"replaying the vision tower's features moves the logits by {live.fmt(max_abs(uncached, replay))}"
    except Exception as exc:  # the probe's own error is the evidence
        return f"replaying the vision tower's features fails: {live.error_text(exc)}"


@pytest.mark.checklist(4)
@pytest.mark.parametrize("name", IMAGE_CASES)
def test_encode_image_replay_gives_identical_logits(original, reference, name):
    """A public ``Model.encode_image``; its output replayed via ``get_input_embeddings(...,
    cached_image_features=...)`` (no pixel values) gives logits identical to the uncached path."""
    model, _ = original
    encode = getattr(model, "encode_image", None)
    assert callable(encode), f"{type(model).__module__}.Model has no public encode_image; " + replay_probe(
        model, reference, name
    )
    ids, pixels, extra = case_inputs(reference(name))
    encoded = encode(pixels, extra["image_grid_thw"])
    uncached = live.prefill_logits(model, ids, pixels, extra)
    replay = live.prefill_logits(model, ids, None, dict(extra, cached_image_features=encoded))
    assert replay.shape == uncached.shape and max_abs(uncached, replay) == 0.0, (
        f"max|replay - uncached logits| {live.fmt(max_abs(uncached, replay))} (must be exactly 0)"
    )


# -------------------------------------------------------- items 5 and 6


def run_probe(script: str, args: Sequence[str] = ()) -> Dict[str, Any]:
    """``tests/support/probes/<script>`` in a fresh interpreter (cwd /, so the checkout is not on sys.path
    unless the vendored package is under test) and its JSON line."""
    vendored = KIND == "vendored"
    # No COMPASS_COMPAT_* switch leaks in (COMPASS_COMPAT_AUTOPATCH=1 would import the shim at start).
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPASS_COMPAT_")}
    if vendored:
        env["COMPASS_COMPAT_IMPLEMENTATION"] = "vendored"
        env["PYTHONPATH"] = str(PROBES.parents[2])  # this checkout's compass_compat
    proc = subprocess.run(
        [sys.executable, str(PROBES / script), *(["--vendored"] if vendored else []), *args],
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT,
        cwd="/",
        env=env,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("PROBE-JSON "):
            return json.loads(line[len("PROBE-JSON ") :])
    pytest.fail(
        f"{script} exited {proc.returncode}: " + " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    )


@pytest.mark.checklist(5)
def test_model_config_registers_cohere_compass():
    """``mlx_vlm.prompt_utils.MODEL_CONFIG`` has ``cohere_compass``: for upstream, read pristine in an
    interpreter that never imports compass_compat (the shim would register it)."""
    out = run_probe("probe_model_config.py")
    if KIND == "upstream":
        assert not out["compass_compat_imported"], "the probe imported compass_compat; not pristine"
    assert out["registered"], f"MODEL_CONFIG has no 'cohere_compass' among its {out['entries']} entries"


@pytest.mark.checklist(6)
def test_processor_builds_without_torch(package, tiny_ckpt_original):
    """With torch hidden (a meta-path finder), ``mlx_vlm.load(folder)`` and ``AutoProcessor.from_pretrained``
    after the package import give the implementation's processor, which processes an image; torch is
    never imported."""
    name = IMAGE_CASES[0]
    out = run_probe("probe_processor.py", [str(tiny_ckpt_original), image_paths(name)[0], INDEX[name]["prompt"]])
    problems = [out["error"]] if "error" in out else []
    for key in ("load_processor", "auto_processor"):
        if key in out and within(out.get(key + "_file"), vendor_root()) != (package == "vendored"):
            problems.append(f"{key} built {out[key]} ({out.get(key + '_file')}), not {package}'s processor")
    if out.get("torch_imported"):
        problems.append("torch was imported")
    if out.get("compass_compat_imported") and package == "upstream":
        problems.append("the probe imported compass_compat")
    assert not problems, "torch hidden: " + "; ".join(problems)
    assert out.get("pixel_values_shape"), out


# ------------------------------------------------------------------ item 7


def vendored_sources() -> List[Tuple[str, Path]]:
    root = vendor_root()
    out = []
    for path in sorted((root / "mlx_vlm").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return out


def external_imports() -> List[Tuple[str, str, List[str]]]:
    """(importing module, imported module, names) for every import of mlx_lm / mlx_vlm / transformers in
    the vendored tree, relative imports resolved; the package's own modules left out."""
    found = []
    for module_name, path in vendored_sources():
        package = module_name if path.name == "__init__.py" else module_name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    target = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                found.append((module_name, target, [alias.name for alias in node.names]))
            elif isinstance(node, ast.Import):
                found.extend((module_name, alias.name, []) for alias in node.names)
    return [
        (importer, target, names)
        for importer, target, names in found
        if not (target == PACKAGE or target.startswith(PACKAGE + "."))
        and target.partition(".")[0] in ("mlx_lm", "mlx_vlm", "transformers")
    ]


def test_import_scan_finds_the_rotary_helper():
    found = {(target, name) for _, target, names in external_imports() for name in names}
    assert ("mlx_lm.models.rope_utils", "initialize_rope") in found
    assert ("mlx_vlm.models.cache", "RotatingKVCache") in found  # `from ..cache import ...`, resolved
    assert not any(t.startswith(PACKAGE) for t, _ in found)


@pytest.mark.checklist(7)
def test_every_name_the_vendored_code_imports_exists():
    missing = []
    for importer, target, names in external_imports():
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # the error is the evidence
            missing.append(f"{target} (imported by {importer}): {live.error_text(exc, 120)}")
            continue
        missing += [
            f"{target}.{name} (imported by {importer})"
            for name in names
            if not hasattr(module, name) and importlib.util.find_spec(f"{target}.{name}") is None
        ]
    assert not missing, "missing: " + "; ".join(missing)


@pytest.mark.checklist(7)
def test_initialize_rope_is_rotate_half_rope():
    """``mlx_lm.models.rope_utils.initialize_rope`` as the vendored ``language.py`` calls it equals
    rotate-half RoPE computed in numpy."""
    import mlx.core as mx
    from mlx_lm.models.rope_utils import initialize_rope

    head_dim, theta, offset = 16, 50000.0, 5
    rope = initialize_rope(head_dim, base=theta, traditional=False)
    x = np.random.default_rng(0).standard_normal((1, 2, 7, head_dim)).astype(np.float32)
    got = np.array(rope(mx.array(x), offset=offset))
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(offset, offset + 7, dtype=np.float64)[:, None] * inv
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))
    half = head_dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    assert max_abs(got, x * cos + rotated * sin) <= 1e-5


@pytest.mark.checklist(7)
def test_the_vendored_package_imports_whole():
    """Live, or beside upstream's under the stand-in name (tests/support/vendored.py)."""
    from tests.support.vendored import vendored_module

    assert hasattr(vendored_module(), "Model")


# ------------------------------------------------------------------ item 8


@pytest.mark.checklist(8)
def test_quantized_checkpoint_loads_and_generates(package, tiny_ckpt_mlx, reference, tmp_path_factory):
    """4-bit group-64 quantized in-process and reloaded with ``mlx_vlm.load``: every quantized module comes
    back quantized, the logits equal the dequantized twin's (1e-3) on text_short and img_448, and
    ``stream_generate`` gives 32 tokens for a text and an image prompt."""
    import mlx.nn as nn

    folder, twin_folder, written = live.quantize_checkpoint(tiny_ckpt_mlx, tmp_path_factory.mktemp("q4"), package)
    model, processor = live.load(folder, package)
    twin, _ = live.load(twin_folder, package)
    quantized = sum(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    problems = [] if quantized == written > 0 else [f"{quantized} quantized modules loaded, {written} written"]
    eos = live.eos_id(tiny_ckpt_mlx)
    for name in (TEXT_CASES[0], IMAGE_CASES[0]):
        ids, pixels, extra = case_inputs(reference(name))
        diff = max_abs(live.prefill_logits(model, ids, pixels, extra), live.prefill_logits(twin, ids, pixels, extra))
        if not diff <= live.QUANT_TWIN_TOL:
            problems.append(f"{name}: quantized logits differ from the dequantized twin's by {live.fmt(diff)}")
        tokens = live.prompt_path(model, processor, INDEX[name]["prompt"], image_paths(name), N_GREEDY)["tokens"]
        if not (len(tokens) == N_GREEDY or (tokens and tokens[-1] == eos)):
            problems.append(f"{name}: stream_generate gave {len(tokens)} tokens")
    assert not problems, "; ".join(problems)


# ------------------------------------------------------------------ item 9


@pytest.mark.checklist(9)
@pytest.mark.parametrize("layout", ["original", "mlx"])
def test_weight_layout_loads_to_the_reference(package, layout, tiny_ckpt_original, tiny_ckpt_mlx, reference):
    """CohereLabs' layout and an MLX conversion load strictly through ``mlx_vlm.load``; prefill logits on
    text_short and img_448 within 1e-4 of the reference."""
    model, _ = live.load(tiny_ckpt_original if layout == "original" else tiny_ckpt_mlx, package)
    for name in (TEXT_CASES[0], IMAGE_CASES[0]):
        case = reference(name)
        diff = max_abs(live.prefill_logits(model, *case_inputs(case)), case["prefill_logits"])
        assert diff <= live.LOGIT_TOL, f"{layout} {name}: max|dlogits| {live.fmt(diff)}"


# ----------------------------------------------------------------- item 10


@pytest.mark.checklist(10)
def test_padding_ids_stream_as_the_reference_decodes_them(original):
    """The detokenizer ``mlx_vlm.load`` attached, fed real ids with two padding ids (the tokenizer's size
    and ``vocab_size - 1``) among them, streams the text of the same ids without them, as transformers'
    ``decode`` gives (re-checked on the pin)."""
    model, processor = original
    tokenizer = getattr(processor, "tokenizer", processor)
    size, vocab = len(tokenizer), int(model.config.text_config.vocab_size)
    assert vocab > size, f"the tiny checkpoint must have padding rows (vocab_size {vocab}, tokenizer {size})"
    words = tokenizer("the picture shows a red square", add_special_tokens=False)["input_ids"]
    padded = words[:2] + [size, vocab - 1] + words[2:]
    assert tokenizer.decode(padded) == tokenizer.decode(words), "this transformers decodes padding ids to text"

    def stream(ids: List[int]) -> str:
        detokenizer = processor.detokenizer
        detokenizer.reset()
        for token in ids:
            detokenizer.add_token(token)
        detokenizer.finalize()
        return detokenizer.text

    want = stream(words)
    try:
        got = stream(padded)
    except Exception as exc:  # the evidence: mlx-vlm's BPE detokenizer raises IndexError unguarded
        pytest.fail(f"{type(processor.detokenizer).__name__} streaming ids {padded}: {live.error_text(exc)}")
    assert got == want, f"{type(processor.detokenizer).__name__}: {got!r}, without the padding ids {want!r}"


# ----------------------------------------------------------------- item 11


@pytest.mark.checklist(11)
@pytest.mark.parametrize("name", list(VIDEO_CASES))
def test_video_case_matches_the_reference(original, name):
    """Recorded video cases (transformers' own processor on ``compass_data.clips`` frames): the model on
    the reference's inputs (logits 1e-4, greedy ids, positions); the processor ``mlx_vlm.load`` built,
    called as transformers' is: prompt ids (the ``<t seconds>`` blocks), pixels (1e-5), grid, and those
    inputs through ``stream_generate`` stream the 32 greedy ids."""
    model, processor = original
    meta = VIDEO_CASES[name]
    problems = live.video_problems(model, processor, VIDEO_MODEL_DIR / "tiny" / meta["file"], meta, IMAGES)
    assert not problems, f"{name}: " + "; ".join(problems)
