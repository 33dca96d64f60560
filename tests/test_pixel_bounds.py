"""Image pixel bounds resolved as transformers resolves them.

Folders with the published layouts of the files that decide the bounds (CohereLabs'
original set; an mlx-vlm >= 0.6.13 conversion with processor_config.json), folders whose
files disagree, and from_pretrained / call kwargs (the table: tests/support/pixel_bounds.py,
the precedence: the "pixel bounds" section of the vendored image processor). Expected values come
from the reference: live in the reference environment (0.7.10, `-m reference`), and from
tests/fixtures/pixel_bounds.json, recorded from it by scripts/reference/pixel_bounds.py, on
every pin. The vendored processor, ``mlx_vlm.utils.load``'s processor and checklist item 3's
probe (tests/support/live.py) all use the one resolution (the image processor's read_pixel_bounds).
"""

from __future__ import annotations

import importlib
import json
import pathlib
import warnings

import numpy as np
import pytest

from compass_compat.checkpoint_checks import CheckpointError, validate_checkpoint
from compass_data.tiny import build_tiny_checkpoint
from tests.support import pixel_bounds as rec
from tests.support.pixel_bounds import pixel_bounds
from tests.support.reference_probe import reference_problem
from tests.support.vendored import default_run_only, vendored

FIXTURE = json.loads(rec.FIXTURE.read_text(encoding="utf-8"))
pc = rec.processing_module()  # the vendored processing module, live or by path
# The vendored processor by path and the checks; mlx_vlm.utils.load's test skips on upstream's run itself.
pytestmark = default_run_only
PIXEL_TOL = 1e-6  # as tests/test_processor.py: PIL resize is shared, float math may round differently


def _has_reference() -> bool:
    # As tests/test_processor.py: transformers ships cohere_compass before 5.21 but resolves
    # differently there (measured with 5.17: tokenizer_config.json's min_pixels or max_pixels
    # alone is not applied, a call `size` beats a from_pretrained min_pixels); the reference is
    # 5.21+'s behaviour, so one without it is skipped like a missing one.
    if reference_problem() is not None:  # tests/support/reference_probe.py
        return False
    try:
        importlib.import_module("transformers.models.cohere_compass.image_processing_pil_cohere_compass")
    except ImportError:
        return False
    return True


needs_reference = pytest.mark.skipif(
    not _has_reference(),
    reason="the live reference is transformers >= 5.21 (the 0.7.10 env); this env compares "
    "with tests/fixtures/pixel_bounds.json (recorded from transformers 5.24) instead",
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pixel_bounds")
    return {name: rec.build_folder(name, root / name) for name in rec.FOLDERS}


@pytest.fixture(scope="module")
def images():
    return {name: rec.make_image(name) for name in rec.IMAGES}


def ours(folder, case):
    _, load_kwargs, call_kwargs = rec.CASES[case]
    processor = pc.CohereCompassProcessor.from_pretrained(folder, **load_kwargs)
    return processor, call_kwargs


def run_ours(processor, image, call_kwargs):
    out = processor(
        text=["<|VISION_START|><|IMAGE_PAD|><|VISION_END|>"], images=[image], return_tensors="np", **call_kwargs
    )
    return {
        "tokens": int(np.sum(np.asarray(out["input_ids"]) == processor.image_token_id)),
        "grid": np.asarray(out["image_grid_thw"]).tolist(),
        "pixel_values": np.asarray(out["pixel_values"]),
    }


def assert_matches_summary(got: dict, want: dict, label: str):
    assert got["tokens"] == want["tokens"], label
    assert got["grid"] == want["grid"], label
    summary = rec.summarize(got["pixel_values"])
    expected = want["pixel_values"]
    assert summary["shape"] == expected["shape"], label
    n = np.prod(expected["shape"])
    assert abs(summary["sum"] - expected["sum"]) <= PIXEL_TOL * n, label
    assert abs(summary["sum_of_squares"] - expected["sum_of_squares"]) <= 4 * PIXEL_TOL * n, label
    np.testing.assert_allclose(summary["samples"], expected["samples"], rtol=0, atol=PIXEL_TOL, err_msg=label)


def test_fixture_covers_the_case_table():
    assert set(FIXTURE["cases"]) == set(rec.CASES)
    for case, (folder, load_kwargs, call_kwargs) in rec.CASES.items():
        entry = FIXTURE["cases"][case]
        assert (entry["folder"], entry["load_kwargs"], entry["call_kwargs"]) == (folder, load_kwargs, call_kwargs)


def test_published_layouts_give_the_measured_counts():
    """The issue's measurement with transformers 5.24 on both published layouts."""
    for case in ("cohere_original", "mlx_conversion"):
        entry = FIXTURE["cases"][case]
        assert entry["bounds"] == [16384, 3868706]
        assert {n: r["tokens"] for n, r in entry["images"].items()} == {"224x224": 49, "4032x3024": 3710}


# The 4032 x 3024 picture takes seconds a call and one of three grids in every case without call
# kwargs: its whole output is compared in the first such case of each grid and in every case with call
# kwargs (a call's size is resolved apart from the image processor's own); the other cases' token
# counts are test_bounds_match_the_recorded_reference's.
BIG = "4032x3024"
WHOLE_BIG = {
    tuple(map(tuple, e["images"][BIG]["grid"])): case
    for case, e in reversed(FIXTURE["cases"].items())
    if not e["call_kwargs"]
}


@pytest.mark.parametrize("case", list(rec.CASES))
def test_processor_matches_the_recorded_reference(case, folders, images):
    warnings.simplefilter("ignore", FutureWarning)
    processor, call_kwargs = ours(folders[rec.CASES[case][0]], case)
    for name, image in images.items():
        want = FIXTURE["cases"][case]["images"][name]
        if name == BIG and not call_kwargs and case not in WHOLE_BIG.values():
            continue
        assert_matches_summary(run_ours(processor, image, call_kwargs), want, f"{case} {name}")


@pytest.mark.parametrize("case", list(rec.CASES))
def test_bounds_match_the_recorded_reference(case, folders):
    """The shared resolution (processor, checklist item 3's probe) on the folder's files."""
    folder_name, load_kwargs, call_kwargs = rec.CASES[case]
    bounds = pixel_bounds(folders[folder_name], load_kwargs, call_kwargs)
    assert [bounds.min_pixels, bounds.max_pixels] == FIXTURE["cases"][case]["bounds"]
    processor, call_kwargs = ours(folders[folder_name], case)
    # The image processor says what a call without kwargs produces (mlx-vlm 0.7.10's estimate).
    if not call_kwargs:
        ip = processor.image_processor
        assert [ip.min_pixels, ip.max_pixels] == FIXTURE["cases"][case]["bounds"]
        for name, (h, w) in rec.IMAGES.items():
            assert ip.num_image_tokens(h, w) == FIXTURE["cases"][case]["images"][name]["tokens"]


def test_sources_name_the_deciding_file(folders):
    original = pixel_bounds(folders["cohere_original"])
    assert (original.min_source, original.max_source) == (
        "tokenizer_config.json min_pixels",
        "tokenizer_config.json max_pixels",
    )
    assert original.image_config_file == "preprocessor_config.json"
    block = pixel_bounds(folders["block_beats_preprocessor"])
    assert block.image_config_file == "processor_config.json image_processor"
    assert block.min_source == "processor_config.json image_processor min_pixels"
    called = pixel_bounds(folders["cohere_original"], {"max_pixels": 1003520}, {"min_pixels": 200704})
    assert (called.min_source, called.max_source) == ("call min_pixels", "from_pretrained max_pixels")


@pytest.mark.parametrize("case", list(rec.CASES))
@pytest.mark.reference  # once, in the reference environment: every pin compares with the fixture above
@needs_reference
def test_processor_matches_the_live_reference(case, folders, images):
    warnings.simplefilter("ignore", FutureWarning)
    folder_name, load_kwargs, call_kwargs = rec.CASES[case]
    reference = rec.reference_processor(folders[folder_name], load_kwargs)
    assert rec.reference_bounds(reference, call_kwargs) == FIXTURE["cases"][case]["bounds"]  # fixture is current
    processor, _ = ours(folders[folder_name], case)
    for name, image in images.items():
        want = rec.reference_run(reference, image, call_kwargs)
        got = run_ours(processor, image, call_kwargs)
        assert (got["tokens"], got["grid"]) == (want["tokens"], want["grid"]), f"{case} {name}"
        assert got["pixel_values"].shape == want["pixel_values"].shape
        assert np.max(np.abs(got["pixel_values"] - want["pixel_values"])) <= PIXEL_TOL, f"{case} {name}"
        assert_matches_summary(want, FIXTURE["cases"][case]["images"][name], f"fixture {case} {name}")


@pytest.mark.reference
@needs_reference
@pytest.mark.parametrize("case", list(rec.LENIENT))
def test_lenient_cases_where_the_reference_raises(case, folders, images):
    """A `size` with one edge and no tokenizer bounds: the reference fails; the other edge
    is kept from the level below (a documented compass-compat delta)."""
    folder_name, load_kwargs, call_kwargs = rec.LENIENT[case]
    reference = rec.reference_processor(folders[folder_name], load_kwargs)
    with pytest.raises(ValueError, match="must contain 'shortest_edge' and 'longest_edge'"):
        rec.reference_run(reference, images["224x224"], call_kwargs)
    bounds = pixel_bounds(folders[folder_name], load_kwargs, call_kwargs)
    assert [bounds.min_pixels, bounds.max_pixels] == [65536, 1003520]


def test_hand_built_processor_reads_the_tokenizer_init_kwargs(folders, images):
    """CohereCompassProcessor(image_processor, tokenizer) merges the tokenizer's init kwargs,
    as transformers' ProcessorMixin does."""
    folder = folders["cohere_original"]
    tokenizer = pc._load_tokenizer(folder)
    image_processor = pc.CohereCompassImageProcessor.from_pretrained(folder)
    assert (image_processor.min_pixels, image_processor.max_pixels) == (65536, 16777216)  # level 1 alone
    processor = pc.CohereCompassProcessor(image_processor=image_processor, tokenizer=tokenizer)
    got = run_ours(processor, images["4032x3024"], {})
    assert got["tokens"] == FIXTURE["cases"]["cohere_original"]["images"]["4032x3024"]["tokens"]


def test_image_processor_from_pretrained_prefers_the_block(folders):
    """On every pin, as transformers 5 picks the file."""
    ip = pc.CohereCompassImageProcessor.from_pretrained(folders["block_beats_preprocessor"])
    assert (ip.min_pixels, ip.max_pixels) == tuple(FIXTURE["cases"]["block_beats_preprocessor"]["bounds"])


@pytest.mark.parametrize("layout", ["original", "mlx"])
def test_tiny_checkpoint_bounds_are_its_tokenizer_configs(tmp_path, layout):
    """The default tiny checkpoint is laid out as published: tokenizer_config.json's
    min/max_pixels decide over preprocessor_config.json's size (and, in the MLX layout, agree
    with processor_config.json's block)."""
    folder = build_tiny_checkpoint(tmp_path, layout=layout)
    want = json.loads((folder / "tokenizer_config.json").read_text())
    size = json.loads((folder / "preprocessor_config.json").read_text())["size"]
    bounds = pixel_bounds(folder)
    assert (bounds.min_pixels, bounds.max_pixels) == (want["min_pixels"], want["max_pixels"])
    assert (bounds.min_pixels, bounds.max_pixels) != (size["shortest_edge"], size["longest_edge"])
    assert (bounds.min_source, bounds.max_source) == (
        "tokenizer_config.json min_pixels",
        "tokenizer_config.json max_pixels",
    )


# ------------------------------------------------------------------ mlx_vlm.utils.load


@pytest.fixture(scope="module")
def loadable(tmp_path_factory):
    """Full tiny checkpoints (weights included) with the published layouts' files."""
    root = tmp_path_factory.mktemp("pixel_bounds_ckpt")
    original = build_tiny_checkpoint(root / "base_original", layout="original")
    mlx = build_tiny_checkpoint(root / "base_mlx", layout="mlx")
    return {
        "cohere_original": rec.build_folder("cohere_original", root / "cohere_original", base=original),
        "mlx_conversion": rec.build_folder("mlx_conversion", root / "mlx_conversion", base=mlx),
    }


@pytest.mark.parametrize("layout", ["cohere_original", "mlx_conversion"])
def test_mlx_vlm_load_processor(layout, loadable, images):
    vendored()  # the vendored package must be live (skips, saying why, on upstream's pass)
    from mlx_vlm.utils import load

    _, processor = load(str(loadable[layout]))
    assert type(processor).__module__.endswith("processing_cohere_compass")
    for name, image in images.items():
        got = run_ours(processor, image, {})
        assert_matches_summary(got, FIXTURE["cases"][layout]["images"][name], f"{layout} {name}")
    ip = processor.image_processor
    assert [ip.min_pixels, ip.max_pixels] == FIXTURE["cases"][layout]["bounds"]


# ------------------------------------------------------------------ checkpoint checks


def _edit(folder: pathlib.Path, name: str, edit) -> None:
    data = json.loads((folder / name).read_text())
    edit(data)
    (folder / name).write_text(json.dumps(data))


def refusal(folder: pathlib.Path, match: str) -> CheckpointError:
    """The CheckpointError building the processor for ``folder`` raises: the vendored image
    processor's own refusal (its message matching ``match``), with the remedy."""
    from transformers import AutoProcessor

    with pytest.raises(CheckpointError, match=match) as info:
        AutoProcessor.from_pretrained(str(folder))
    assert "Restore the image settings published with the checkpoint" in str(info.value)
    return info.value


def test_checks_accept_the_published_layouts(loadable):
    for folder in loadable.values():
        validate_checkpoint(folder)


def test_processor_refuses_bad_tokenizer_bounds(loadable, tmp_path):
    folder = rec.build_folder("cohere_original", tmp_path / "bad", base=loadable["cohere_original"])
    _edit(folder, "tokenizer_config.json", lambda c: c.__setitem__("max_pixels", 0))
    refusal(folder, r"`size\.longest_edge \(max_pixels\)` must be a positive integer, got 0")
    _edit(folder, "tokenizer_config.json", lambda c: (c.pop("max_pixels"), c.__setitem__("size", 1024)))
    refusal(folder, r"TypeError: 'int' object is not iterable")


def test_processor_reads_tokenizer_bounds_without_a_settings_file(loadable, tmp_path):
    folder = rec.build_folder("cohere_original", tmp_path / "bare", base=loadable["cohere_original"])
    (folder / "preprocessor_config.json").unlink()
    _edit(folder, "tokenizer_config.json", lambda c: c.__setitem__("min_pixels", -1))
    refusal(folder, r"`size\.shortest_edge \(min_pixels\)` must be a positive integer, got -1")


def test_processor_refuses_min_over_max_across_files(loadable, tmp_path):
    """tokenizer_config.json's min_pixels over the block's max pixels."""
    folder = rec.build_folder("mlx_conversion", tmp_path / "crossed", base=loadable["mlx_conversion"])
    _edit(folder, "tokenizer_config.json", lambda c: (c.pop("max_pixels"), c.__setitem__("min_pixels", 4000000)))
    refusal(folder, r"`size\.shortest_edge` \(4000000\) exceeds `size\.longest_edge` \(3868706\)")


def test_processor_refuses_a_bad_block(loadable, tmp_path):
    """processor_config.json's block is what the image processor reads."""
    folder = rec.build_folder("mlx_conversion", tmp_path / "block", base=loadable["mlx_conversion"])
    _edit(folder, "processor_config.json", lambda c: c["image_processor"].__setitem__("patch_size", 0))
    refusal(folder, r"cohere_compass image processor: `patch_size` must be a positive integer, got 0")


# ------------------------------------------------------------ checklist item 3's probe


def test_image_files_probe_uses_the_shared_resolution(monkeypatch, tmp_path):
    """The probe's expected grids are ``pixel_bounds`` of the probed folder: with tokenizer_config.json
    bounds added to it, the probe expects those (tests/support/live.py, tests/test_live_package.py)."""
    from tests.support import live

    seen = []
    original = rec.pixel_bounds

    def spy(folder, *args, **kwargs):
        bounds = original(folder, *args, **kwargs)
        seen.append(bounds)
        return bounds

    monkeypatch.setattr(rec, "pixel_bounds", spy)
    folder = build_tiny_checkpoint(tmp_path / "probe", variant="small_max_pixels")
    _edit(folder, "tokenizer_config.json", lambda c: c.update(min_pixels=4096, max_pixels=32768))
    want = live.image_files_expectations(folder)
    assert [(b.min_pixels, b.max_pixels) for b in seen] == [(4096, 32768)]
    # 64x64 is within [4096, 32768]: kept; 640x480 shrinks under 32768 pixels (sides multiples of 32).
    assert want["grids"] == {"solid 64x64": [1, 4, 4], "640x480": [1, 8, 12]}


def test_smart_resize_expectations_are_exact_arithmetic():
    from tests.support.live import smart_resize

    # Image preprocessing: 448x448 stays, 20x20 grows to the min bound, 640x480 shrinks.
    assert smart_resize(448, 448, 32, 65536, 16777216) == (448, 448)
    assert smart_resize(20, 20, 32, 65536, 16777216) == (256, 256)
    assert smart_resize(480, 640, 32, 16384, 65536) == (192, 288)
    assert smart_resize(64, 64, 32, 16384, 65536) == (128, 128)
