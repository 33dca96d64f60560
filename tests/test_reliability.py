"""Broken checkpoints, hostile checkpoint folders and bad requests.

Every case asserts the exact error class and a message that says what to do, twice where
it applies: what ``mlx_vlm.load`` raises on this pin (mlx-vlm's loader reads config.json
and the weights before any compass-compat code runs, so some of those errors are mlx-vlm's
or MLX's own) and what ``compass_compat.checkpoint_checks.validate_checkpoint`` (the
pre-flight a host can run, and that the vendored processor runs on every load) raises.
Per-pin differences are spelled out next to the case (tests/lib/broken_checkpoints.py).
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Dict

import numpy as np
import pytest
from PIL import Image

from scripts._lib.mlx_vlm_run import chat_prompt as prompt_for
from tests.lib.broken_checkpoints import BROKEN, make_broken
from tests.lib.checkpoints import copy_checkpoint, edit_json, quantize_checkpoint
from tests.lib.host_calls import MAX_TOKENS, generate, load
from tests.lib.images import png_claiming
from tests.lib.vendored import vendored

compass = vendored("cohere_compass")
processing = vendored("processing_cohere_compass")

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from compass_compat.checkpoint_checks import CheckpointError, expected_tensors, validate_checkpoint  # noqa: E402
from compass_data.tiny import special_token_ids  # noqa: E402

IDS = special_token_ids()


# ---------------------------------------------------------------- broken checkpoints


@pytest.fixture(scope="session")
def quantized_ckpt(tiny_ckpt_original, tmp_path_factory) -> Path:
    return quantize_checkpoint(tiny_ckpt_original, tmp_path_factory.mktemp("q4") / "ckpt")


def test_the_good_checkpoints_pass_every_check(tiny_ckpt_original, tiny_ckpt_mlx, quantized_ckpt):
    for folder in (tiny_ckpt_original, tiny_ckpt_mlx):
        report = validate_checkpoint(folder)
        assert report.weight_files == ("model.safetensors",) and report.quantization is None
    assert validate_checkpoint(quantized_ckpt).quantization == {"group_size": 32, "bits": 4}


def test_quantized_checkpoint_loads_and_generates(quantized_ckpt, reference):
    loaded = load(quantized_ckpt)
    assert type(loaded[0].language_model.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    assert len(generate(loaded, reference("text_short")["meta"]["prompt"])) == MAX_TOKENS


def test_expected_tensors_match_the_model_tree(tiny_ckpt_original):
    """The arithmetic in checkpoint_checks agrees with the vendored module tree."""
    config = json.loads((tiny_ckpt_original / "config.json").read_text())
    for tie, bias in ((True, False), (False, True)):
        config["tie_word_embeddings"] = tie
        config["text_config"]["attention_bias"] = bias
        model_config = compass.ModelConfig.from_dict(config)
        tree = {k: tuple(v.shape) for k, v in tree_flatten(compass.Model(model_config).parameters())}
        assert tree == {k: shape for k, (shape, _) in expected_tensors(model_config).items()}


@pytest.mark.parametrize("case", BROKEN, ids=lambda c: c.name)
def test_broken_checkpoint_load_error(case, tiny_ckpt_original, quantized_ckpt, tmp_path):
    folder = make_broken(case, tiny_ckpt_original, quantized_ckpt, tmp_path)
    exc, pattern = case.load
    pattern = pattern_dotall(case.check) if pattern is None else pattern
    with pytest.raises(exc, match=pattern) as info:
        load(folder)
    assert type(info.value) is exc


@pytest.mark.parametrize("case", BROKEN, ids=lambda c: c.name)
def test_broken_checkpoint_validation_error(case, tiny_ckpt_original, quantized_ckpt, tmp_path):
    folder = make_broken(case, tiny_ckpt_original, quantized_ckpt, tmp_path)
    with pytest.raises(CheckpointError, match=pattern_dotall(case.check)) as info:
        validate_checkpoint(folder)
    assert type(info.value) is CheckpointError and isinstance(info.value, ValueError)
    assert info.value.folder == folder


def pattern_dotall(pattern: str) -> str:
    return "(?s)" + pattern


# ---------------------------------------------------------------- loading is safe


def assert_refused(folder: Path, message: str) -> None:
    """validate_checkpoint and the loader guard (before mlx-vlm reads the folder) both refuse it."""
    with pytest.raises(CheckpointError, match=message):
        validate_checkpoint(folder)
    with pytest.raises(CheckpointError, match=message):
        load(folder)


EVIL_CODE = "from pathlib import Path\nPath({marker!r}).write_text('ran')\n"


class _Unpickled:
    """Unpickling this runs code that writes a marker file (as a hostile pickle would)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (EVIL_CODE.format(marker=self.marker),))


def test_pickle_next_to_safetensors_is_never_unpickled(tiny_ckpt_original, tmp_path, reference):
    folder = copy_checkpoint(tiny_ckpt_original, tmp_path / "ckpt")
    marker = tmp_path / "unpickled"
    for name in ("pytorch_model.bin", "training_args.bin", "model.pt"):
        (folder / name).write_bytes(pickle.dumps(_Unpickled(marker)))
    loaded = load(folder)
    prompt = reference("text_short")["meta"]["prompt"]
    assert generate(loaded, prompt) == generate(load(tiny_ckpt_original), prompt)
    assert validate_checkpoint(folder).ignored_files == ("model.pt", "pytorch_model.bin", "training_args.bin")
    assert not marker.exists()


def test_pickle_only_checkpoint_is_refused_unopened(tiny_ckpt_original, tmp_path):
    folder = copy_checkpoint(tiny_ckpt_original, tmp_path / "ckpt")
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Unpickled(marker)))
    refusal = r"holds only pickle weights \(pytorch_model\.bin\); compass-compat reads safetensors only and never unpickles: convert them"
    assert_refused(folder, refusal)
    assert not marker.exists()


def _remote_code_checkpoint(good: Path, folder: Path, marker: Path) -> Path:
    copy_checkpoint(good, folder)
    for name in ("evil.py", "configuration_evil.py", "processing_evil.py", "tokenization_evil.py"):
        (folder / name).write_text(EVIL_CODE.format(marker=str(marker)), encoding="utf-8")
    auto_map = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoProcessor": "processing_evil.EvilProcessor",
        "AutoImageProcessor": "processing_evil.EvilImageProcessor",
        "AutoTokenizer": ["tokenization_evil.EvilTokenizer", "tokenization_evil.EvilTokenizer"],
        "AutoModelForImageTextToText": "evil.EvilModel",
    }
    for name in ("config.json", "tokenizer_config.json", "preprocessor_config.json"):
        edit_json(folder, name, lambda c: c.__setitem__("auto_map", auto_map))
    return folder


def test_remote_code_is_never_run_even_when_asked(tiny_ckpt_original, tmp_path, reference):
    marker = tmp_path / "ran"
    folder = _remote_code_checkpoint(tiny_ckpt_original, tmp_path / "ckpt", marker)
    loaded = load(folder, trust_remote_code=True)
    prompt = reference("img_448")["meta"]["prompt"]
    image = str(Path(__file__).parent / "fixtures" / "images" / "synth_448x448.png")
    assert generate(loaded, prompt, [image]) == generate(load(tiny_ckpt_original), prompt, [image])
    assert "auto_map is ignored" in " ".join(validate_checkpoint(folder).notes)
    assert not marker.exists()


# mlx-vlm >= 0.7 imports config.json's "model_file" from the checkpoint folder inside
# get_model_and_args, before any compass-compat code can run; 0.3.9 to 0.6.12 ignore the key.
def test_model_file_in_config_is_never_executed(tiny_ckpt_original, tmp_path):
    marker = tmp_path / "ran"
    folder = copy_checkpoint(tiny_ckpt_original, tmp_path / "ckpt")
    (folder / "evil.py").write_text(EVIL_CODE.format(marker=str(marker)), encoding="utf-8")
    edit_json(folder, "config.json", lambda c: c.__setitem__("model_file", "evil.py"))
    message = r"declares model_file='evil\.py': mlx-vlm >= 0\.7 would execute that file\. .* remove the model_file key"
    with pytest.raises(CheckpointError, match=message):
        validate_checkpoint(folder)
    try:
        load(folder)
        outcome = None
    except Exception as err:  # kept and asserted on below, after the marker check
        outcome = err
    assert not marker.exists(), f"mlx-vlm ran the checkpoint's model_file (then raised {outcome!r})"
    assert type(outcome) is CheckpointError and re.search(message, str(outcome)), outcome


@pytest.fixture()
def outside(tmp_path, tiny_ckpt_original) -> Path:
    """A folder next to the checkpoint holding a full copy of its files."""
    return copy_checkpoint(tiny_ckpt_original, tmp_path / "outside")


def _spy_tokenizer_loads(monkeypatch) -> list:
    calls = []
    original = processing._load_tokenizer

    def spy(path):
        calls.append(path)
        return original(path)

    monkeypatch.setattr(processing, "_load_tokenizer", spy)
    return calls


def test_symlinked_weights_outside_the_folder_are_refused(tiny_ckpt_original, tmp_path, outside):
    folder = copy_checkpoint(tiny_ckpt_original, tmp_path / "ckpt")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(outside / "model.safetensors")
    message = (
        r"entry 'model\.safetensors' in .* is a link to .*/outside/model\.safetensors, outside the "
        r"checkpoint folder; .*copy the file into the folder"
    )
    # The shim's loader guard refuses the folder before mlx-vlm globs and reads the weights.
    assert_refused(folder, message)


def test_symlinked_tokenizer_outside_the_folder_is_refused_before_reading(
    tiny_ckpt_original, tmp_path, outside, monkeypatch
):
    folder = copy_checkpoint(tiny_ckpt_original, tmp_path / "ckpt")
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    calls = _spy_tokenizer_loads(monkeypatch)
    message = r"entry 'tokenizer\.json' in .* is a link to .*outside the checkpoint folder"
    with pytest.raises(CheckpointError, match=message):
        load(folder)
    assert calls == []  # refused before the processor read any tokenizer file


def test_index_shard_paths_cannot_leave_the_folder(tiny_ckpt_original, tmp_path, outside):
    folder = copy_checkpoint(tiny_ckpt_original, tmp_path / "ckpt")
    keys = load_file(str(folder / "model.safetensors"))
    shard = "../outside/model.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: shard for k in keys}}))
    message = (
        r"model\.safetensors\.index\.json shard '\.\./outside/model\.safetensors' in .* points "
        r"outside the checkpoint folder"
    )
    # mlx-vlm >= 0.6 would read the shards an index names (here the outside file); the shim's
    # loader guard refuses the folder first.
    assert_refused(folder, message)


def test_a_hugging_face_cache_snapshot_of_symlinks_loads(tiny_ckpt_original, tmp_path, reference):
    repo = tmp_path / "hub" / "models--CohereLabs--tiny-compass"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, source in enumerate(sorted(tiny_ckpt_original.iterdir())):
        blob = blobs / f"blob{i:02d}"
        shutil.copyfile(source, blob)
        (snapshot / source.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    assert validate_checkpoint(snapshot).weight_files == ("model.safetensors",)
    prompt = reference("text_short")["meta"]["prompt"]
    assert generate(load(snapshot), prompt) == generate(load(tiny_ckpt_original), prompt)


# ---------------------------------------------------------------- requests


@pytest.fixture(scope="module")
def loaded(tiny_ckpt_original):
    return load(tiny_ckpt_original)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Dict[str, Path]:
    folder = tmp_path_factory.mktemp("request_images")
    Image.effect_noise((300, 300), 60).convert("RGB").save(folder / "noise.png")
    out = {"noise": folder / "noise.png"}
    data = (folder / "noise.png").read_bytes()
    (folder / "truncated.png").write_bytes(data[: len(data) // 2])
    out["truncated"] = folder / "truncated.png"
    (folder / "text.png").write_text("this is not an image", encoding="utf-8")
    out["not_an_image"] = folder / "text.png"
    Image.new("RGB", (1, 1), (200, 30, 90)).save(folder / "one.png")
    out["one_pixel"] = folder / "one.png"
    Image.new("RGB", (4020, 20), (10, 20, 30)).save(folder / "wide.png")
    out["too_wide"] = folder / "wide.png"
    Image.new("RGB", (4000, 20), (10, 20, 30)).save(folder / "wide_ok.png")
    out["wide_ok"] = folder / "wide_ok.png"
    out["huge"] = png_claiming(folder / "huge.png", 20000, 20000)
    return out


def test_truncated_image_file(loaded, images):
    prompt = prompt_for(loaded, "Describe.", 1)
    # mlx-vlm's load_image opens the file lazily and converts outside its try block: PIL's
    # OSError reaches the caller unwrapped, on every pin.
    with pytest.raises(OSError, match=r"^image file is truncated") as info:
        generate(loaded, prompt, [str(images["truncated"])])
    assert type(info.value) is OSError
    with pytest.raises(ValueError, match=r"cannot read image file '.*truncated\.png': image file is truncated"):
        loaded[1](text=prompt, images=[str(images["truncated"])])


def test_file_that_is_not_an_image(loaded, images):
    prompt = prompt_for(loaded, "Describe.", 1)
    with pytest.raises(ValueError, match=r"^Failed to load image from .*text\.png.*cannot identify image file"):
        generate(loaded, prompt, [str(images["not_an_image"])])
    with pytest.raises(ValueError, match=r"cannot read image file '.*text\.png': cannot identify image file"):
        loaded[1](text=prompt, images=[str(images["not_an_image"])])


def test_one_pixel_image_is_scaled_up_to_min_pixels_and_generates(loaded, images, tiny_ckpt_original):
    processor = loaded[1]
    prompt = prompt_for(loaded, "Describe.", 1)
    out = processor(text=prompt, images=[str(images["one_pixel"])], return_tensors="np")
    # smart_resize by exact arithmetic: round(1/32)*32 = 0 < min pixels 16384, so both sides
    # grow by sqrt(16384) = 128 and round up to 128: grid [1, 8, 8], 16 image tokens.
    assert out["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert int(np.sum(np.asarray(out["input_ids"]) == IDS["<|IMAGE_PAD|>"])) == 16
    assert out["pixel_values"].shape == (64, 3 * 2 * 16 * 16)
    reference = _reference_image_processor(tiny_ckpt_original)
    if reference is not None:  # transformers >= 5.21: compare with its own processor, bit for bit
        want = reference(images=[Image.open(images["one_pixel"]).convert("RGB")], return_tensors="np")
        np.testing.assert_array_equal(np.asarray(want["image_grid_thw"]), out["image_grid_thw"])
        np.testing.assert_array_equal(np.asarray(want["pixel_values"]), out["pixel_values"])
    fed: list = []
    ids = generate(loaded, prompt, [str(images["one_pixel"])], fed=fed)
    assert len(ids) == MAX_TOKENS or ids[-1] == IDS["<|END_OF_TURN_TOKEN|>"]
    assert fed[0]["input_ids"][0].tolist().count(IDS["<|IMAGE_PAD|>"]) == 16


def _reference_image_processor(folder: Path):
    try:
        from transformers.models.cohere_compass.image_processing_pil_cohere_compass import (
            CohereCompassImageProcessorPil,
        )
    except ImportError:
        return None  # transformers < 5.21 (pin 0.3.9): the exact-arithmetic checks above stand alone
    config = json.loads((folder / "preprocessor_config.json").read_text())
    keys = (
        "patch_size",
        "merge_size",
        "temporal_patch_size",
        "size",
        "resample",
        "do_convert_rgb",
        "do_rescale",
        "rescale_factor",
        "do_normalize",
        "image_mean",
        "image_std",
    )
    settings = {k: config[k] for k in keys}
    # transformers' processor merges tokenizer_config.json's bounds over the file's size.
    tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
    settings["size"] = {"shortest_edge": tokenizer["min_pixels"], "longest_edge": tokenizer["max_pixels"]}
    return CohereCompassImageProcessorPil(**settings)


def test_huge_image_file_is_refused_before_decoding(loaded, images):
    prompt = prompt_for(loaded, "Describe.", 1)
    bomb = r"Image size \(400000000 pixels\) exceeds limit of \d+ pixels, could be decompression bomb"
    # PIL's guard fires in Image.open, on the header alone. What this mlx-vlm's own load_image
    # makes of it decides what generate raises: 0.3.9's wraps only IOError, so PIL's
    # DecompressionBombError reaches the caller as is; 0.4.4 and later wrap every error in ValueError.
    from mlx_vlm.utils import load_image

    with pytest.raises(Exception) as pin_error:
        load_image(str(images["huge"]))
    expected = type(pin_error.value)
    assert expected in (Image.DecompressionBombError, ValueError), pin_error.value
    if expected is Image.DecompressionBombError:
        pattern = "^" + bomb
    else:
        pattern = r"^Failed to load image from .*huge\.png.*" + bomb
    with pytest.raises(expected, match=pattern) as info:
        generate(loaded, prompt, [str(images["huge"])])
    assert type(info.value) is expected
    with pytest.raises(ValueError, match=r"cannot read image file '.*huge\.png': " + bomb):
        loaded[1](text=prompt, images=[str(images["huge"])])


def _measure_rss(*args: str) -> dict:
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "preprocess_rss.py"
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_huge_in_memory_image_is_bounded_by_max_pixels_in_tokens_and_memory():
    """20000x20000 RGB (1.5 GiB as a PIL image) with the tiny checkpoint's pixel bounds."""
    result = _measure_rss("--side", "20000", "--min-pixels", "16384", "--max-pixels", "602112")
    assert result["grid_thw"] == [1, 48, 48] and result["image_tokens"] == 576
    assert 48 * 48 * 256 <= 602112
    # Growth over the image itself: PIL's two-pass resize keeps one 768 x 20000 band, plus
    # the 768x768 output and its float copies. Nothing scales with the 20000x20000 area.
    assert result["peak_over_image_mib"] < 128, result


@pytest.mark.parametrize("mode", ["L", "RGBA"])
def test_huge_non_rgb_image_is_bounded_in_memory(mode):
    """Non-RGB input is converted band by band, never as a whole RGB(A) copy of the input."""
    result = _measure_rss("--side", "8000", "--mode", mode, "--min-pixels", "16384", "--max-pixels", "602112")
    assert result["image_tokens"] == 576
    # A whole-image conversion would add 244 MiB (one RGB copy of 8000x8000) or more.
    assert result["peak_over_image_mib"] < 128, result


def test_aspect_ratio_over_200(loaded, images):
    prompt = prompt_for(loaded, "Describe.", 1)
    with pytest.raises(
        ValueError,
        match=r"^Failed to process inputs with error: image of 4020x20 pixels has aspect "
        r"ratio 201\.0; cohere_compass accepts at most 200\. Crop or pad the image first\.",
    ):
        generate(loaded, prompt, [str(images["too_wide"])])
    assert len(generate(loaded, prompt, [str(images["wide_ok"])], max_tokens=2)) == 2  # exactly 200 is fine


@pytest.mark.parametrize("placeholders, given", [(1, 2), (2, 1), (0, 1)])
def test_images_and_placeholders_must_match(loaded, images, placeholders, given):
    prompt = prompt_for(loaded, "Describe.", placeholders)
    with pytest.raises(
        ValueError,
        match=rf"^Failed to process inputs with error: the text has {placeholders} "
        rf"<\|IMAGE_PAD\|> placeholder\(s\) but {given} image\(s\) were passed; they must match",
    ):
        generate(loaded, prompt, [str(images["noise"])] * given)


def test_placeholder_without_any_image_runs_as_text_like_the_reference(loaded):
    """No image at all: mlx-vlm tokenizes the prompt itself and never calls the processor, so
    the pad token goes in as an ordinary token, as in transformers (which checks placeholders
    only when pixel_values are given). Recorded here as the current behaviour."""
    fed: list = []
    ids = generate(loaded, prompt_for(loaded, "Describe.", 1), None, fed=fed)
    assert len(ids) == MAX_TOKENS and fed[0]["input_ids"][0].tolist().count(IDS["<|IMAGE_PAD|>"]) == 1


def test_empty_prompt_generates_from_bos(loaded):
    fed: list = []
    ids = generate(loaded, "", None, fed=fed)
    assert fed[0]["input_ids"].tolist() == [[IDS["<BOS_TOKEN>"]]]
    assert len(ids) == MAX_TOKENS
    with pytest.raises(ValueError, match=r"the text has 0 <\|IMAGE_PAD\|> placeholder\(s\) but 1 image\(s\)"):
        generate(loaded, "", [str(Path(__file__).parent / "fixtures" / "images" / "synth_448x448.png")])


def test_prompt_longer_than_several_sliding_windows(loaded, reference):
    from scripts._lib.parity import greedy

    case = reference("text_long")  # 132 tokens: more than 8 windows of 16
    want = case["greedy_ids"].tolist()[:MAX_TOKENS]
    assert generate(loaded, case["meta"]["prompt"]) == want
    # ~60 windows: mlx-vlm's generation equals one full prefill plus plain decode steps.
    text = " ".join(["the keeper walked along the shore counting boats"] * 80)
    prompt = prompt_for(loaded, text, 0)
    ids = loaded[1].tokenizer(prompt, add_special_tokens=True)["input_ids"]
    assert len(ids) > 60 * 16
    assert generate(loaded, prompt) == greedy(loaded[0], {"input_ids": np.array([ids])}, MAX_TOKENS)


def test_cached_features_replayed_for_the_wrong_image(loaded, reference):
    model = loaded[0]
    a, b = reference("img_448"), reference("img_501x379")  # grids [1, 28, 28] and [1, 24, 32]
    cached = model.encode_image(mx.array(a["pixel_values"]), a["image_grid_thw"])
    with pytest.raises(
        ValueError,
        match=r"the prompt has 192 image tokens but the image features cover 196 tokens\."
        r" Each image needs exactly one image placeholder, .* replayed features must come "
        r"from the same images",
    ):
        model.get_input_embeddings(
            mx.array(b["input_ids"]), cached_image_features=cached, image_grid_thw=b["image_grid_thw"]
        )
    # Same token count, other grid: 196 tokens as [1, 14, 56] instead of [1, 28, 28]. Only the
    # dict form carries the grid it was encoded for (the array form is what hosts cache).
    D = model.config.text_config.hidden_size
    parts = mx.split(cached, cached.shape[-1] // D, axis=-1)
    cached = {
        "image_features": parts[0],
        "deepstack_features": mx.stack(parts[1:]),
        "image_grid_thw": mx.array(a["image_grid_thw"]),
    }
    with pytest.raises(
        ValueError,
        match=r"cached_image_features were encoded for image grids \[\[1, 28, 28\]\] "
        r"but the "
        r"prompt's images have grids \[\[1, 14, 56\]\]; re-encode the images",
    ):
        model.get_input_embeddings(
            mx.array(a["input_ids"]), cached_image_features=cached, image_grid_thw=np.array([[1, 14, 56]])
        )
