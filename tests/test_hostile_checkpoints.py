"""Hostile checkpoint folders: loading never unpickles, never runs the folder's code, never reads
a file outside the folder; each refusal names the file and says what to do.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest

from tests.support.checkpoints import copy_checkpoint, edit_json
from tests.support.host_calls import generate, load
from tests.support.vendored import vendored

processing = vendored("processing_cohere_compass")

from safetensors.numpy import load_file  # noqa: E402

from compass_compat.checkpoint_checks import CheckpointError, validate_checkpoint  # noqa: E402


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
    validate_checkpoint(folder)
    assert not marker.exists()


def test_pickle_only_checkpoint_is_refused_unopened(tiny_ckpt_original, tmp_path):
    folder = copy_checkpoint(tiny_ckpt_original, tmp_path / "ckpt")
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Unpickled(marker)))
    # mlx-vlm's own refusal: it globs *.safetensors only.
    with pytest.raises(
        CheckpointError, match=r"cannot be read \(FileNotFoundError: No safetensors found in .*download"
    ):
        load(folder)
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
    assert not marker.exists()


# mlx-vlm >= 0.7 imports config.json's "model_file" from the checkpoint folder inside
# get_model_and_args, before any compass-compat code can run; 0.4.4 to 0.6.12 ignore the key.
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
    validate_checkpoint(snapshot)
    prompt = reference("text_short")["meta"]["prompt"]
    assert generate(load(snapshot), prompt) == generate(load(tiny_ckpt_original), prompt)
