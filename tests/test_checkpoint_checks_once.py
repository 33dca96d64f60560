"""A checkpoint folder is checked on every load, and a refusal reaches the user once, the same on
every entry point.

``mlx_vlm.load`` reaches the folder checks twice (the shim's loader guard, then its processor hook).
What a user sees: a good folder loads, and the checks take a small part of the load's time; a
folder refused is refused once per load with one message, whatever entry point was used; a folder
that turns bad between loads, or during one, is refused, never passed on an earlier verdict.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict

import pytest

from compass_compat.checkpoint_checks import CheckpointError, validate_checkpoint
from compass_compat.load_checks import SETTLED_NS
from compass_data.tiny import build_tiny_checkpoint
from tests.lib.vendored import vendored

vendored()  # skips the module where upstream's cohere_compass is live (the hooks are not installed)


def settle() -> None:
    """Wait until what was just written is older than SETTLED_NS: a verdict on a folder changed
    more recently is not handed on (a same-size rewrite in the same timestamp tick keeps a stat)."""
    time.sleep(SETTLED_NS / 1e9 + 0.3)


def corrupt_header(folder: Path) -> None:
    """Same size, same inode: the header's JSON no longer parses."""
    with open(folder / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"\xff" * 8)


def in_lane(lane: ThreadPoolExecutor, action: Callable[[Path], object], folder: Path) -> object:
    return lane.submit(action, folder).result()


def load_model(folder: Path) -> object:
    import mlx_vlm.utils

    return mlx_vlm.utils.load_model(Path(folder), lazy=True)


def build_processor(folder: Path) -> object:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(folder))


def generate_cli(folder: Path):
    """(exit code, stderr) of ``python -m compass_compat generate --model folder``, in this process."""
    from compass_compat import cli

    argv = ["generate", "--model", str(folder), "--no-image", "--prompt", "Hi", "--max-tokens", "1"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv + ["--temperature", "0", "--no-verbose"])
    return code, err.getvalue()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Dict[str, Path]:
    """Settled tiny checkpoints: "good", "bad" (a corrupted header) and "turns bad" (good until a test breaks it)."""
    root = tmp_path_factory.mktemp("checked_once")
    good = build_tiny_checkpoint(root / "good", layout="mlx")
    out = {"good": good, "bad": Path(shutil.copytree(good, root / "bad"))}
    corrupt_header(out["bad"])
    out["turns bad"] = Path(shutil.copytree(good, root / "turns_bad"))
    settle()
    return out


def test_the_checks_take_a_small_part_of_a_load(folders):
    """Even checked twice (guard and processor hook), a warm load of the tiny checkpoint, the
    cheapest load there is, spends under half its time on the checks (each timed five times,
    interleaved, the fastest kept: a busy machine slows both). A check reads headers, never
    tensor data, so against a real checkpoint's load it is far smaller still."""
    import mlx_vlm

    good = folders["good"]
    loads, checks = [], []
    for _ in range(5):
        for times, action in ((loads, lambda: mlx_vlm.load(str(good))), (checks, lambda: validate_checkpoint(good))):
            start = time.perf_counter()
            action()
            times.append(time.perf_counter() - start)
    assert 2 * min(checks) < min(loads) / 2, (checks, loads)


def test_cli_generate_on_a_good_folder(folders):
    code, stderr = generate_cli(folders["good"])
    assert code == 0, stderr


def test_a_folder_broken_during_a_load_is_refused_by_its_next_step(folders):
    """Corrupted after the loader guard passed it: the processor hook of the same load refuses it."""
    folder = folders["turns bad"]
    with ThreadPoolExecutor(max_workers=1) as lane:  # one thread: a load's steps run on one thread
        in_lane(lane, load_model, folder)
        corrupt_header(folder)
        settle()  # old again: only the entries' stats can tell
        with pytest.raises(CheckpointError) as usual:
            validate_checkpoint(folder, require_weights=False)
        with pytest.raises(CheckpointError) as refused:
            in_lane(lane, build_processor, folder)
    assert str(refused.value) == str(usual.value)
    assert "not a valid safetensors file" in str(refused.value)


def test_folder_that_became_bad_is_refused_on_the_next_load(folders, tmp_path):
    import mlx_vlm

    folder = Path(shutil.copytree(folders["good"], tmp_path / "ckpt"))
    mlx_vlm.load(str(folder))
    corrupt_header(folder)
    settle()
    with pytest.raises(CheckpointError) as usual:
        validate_checkpoint(folder)
    with pytest.raises(CheckpointError) as refused:
        mlx_vlm.load(str(folder))
    assert str(refused.value) == str(usual.value)


def _refusal(action: Callable[[], object]) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        action()
    return info.value


def test_a_refusal_is_the_same_on_every_entry_point(folders):
    import mlx_vlm

    bad = folders["bad"]
    usual = _refusal(lambda: validate_checkpoint(bad))
    assert "not a valid safetensors file" in str(usual) and usual.__cause__ is not None
    refusals: Dict[str, CheckpointError] = {}

    def refuse(where: str, action: Callable[[], object]) -> None:
        refusals[where] = _refusal(action)

    refuse("AutoProcessor alone", lambda: build_processor(bad))
    refuse("validate_checkpoint(require_weights=False)", lambda: validate_checkpoint(bad, require_weights=False))
    refuse("mlx_vlm.load", lambda: mlx_vlm.load(str(bad)))
    refuse("load_model", lambda: load_model(bad))
    refuse("AutoProcessor after load_model", lambda: build_processor(bad))
    for where, err in refusals.items():
        assert type(err) is CheckpointError, where
        assert (str(err), err.folder, err.file) == (str(usual), usual.folder, usual.file), where
        assert type(err.__cause__) is type(usual.__cause__) and str(err.__cause__) == str(usual.__cause__), where
    code, stderr = generate_cli(bad)
    assert code == 2 and f"CheckpointError: {usual}" in stderr, stderr
