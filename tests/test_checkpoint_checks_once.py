"""One check of a checkpoint folder per load.

``mlx_vlm.load`` reaches the folder checks twice: the shim's loader guard, then its processor
hook. The hook takes the guard's verdict when nothing in the folder changed since, so a load
reads the folder's safetensors headers once. Counted here from outside: every ``open`` of a
``*.safetensors`` file by Python code is an audit event (mlx reads tensor data in C++, which
raises none), and the checks are the only Python code that opens them.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List

import pytest

from compass_compat.checkpoint_checks import CheckpointError, validate_checkpoint
from compass_compat.load_checks import SETTLED_NS
from compass_data.tiny import build_tiny_checkpoint
from tests.lib.vendored import vendored

vendored()  # skips the module where upstream's cohere_compass is live (the hooks are not installed)

_OPENED: List[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if path.endswith(".safetensors"):
            _OPENED.append(os.path.realpath(path))


sys.addaudithook(_audit)  # for the rest of the process: audit hooks cannot be removed


def header_reads(folder: Path, action: Callable[..., object], *args: object) -> int:
    """How many times ``action(*args)`` opens a safetensors file of ``folder``."""
    start = len(_OPENED)
    action(*args)
    real = os.path.realpath(folder)
    return sum(1 for path in _OPENED[start:] if os.path.dirname(path) == real)


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


def _rewrite_weights(folder: Path) -> None:
    path = folder / "model.safetensors"
    data = path.read_bytes()
    with open(path, "r+b") as f:  # the same bytes in place: only mtime and ctime move
        f.write(data)


def _edit_config(folder: Path) -> None:
    path = folder / "config.json"
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("\n", " ", 1), encoding="utf-8")  # same size, same meaning


def _replace_tokenizer_config(folder: Path) -> None:
    path = folder / "tokenizer_config.json"
    fresh = folder / "tokenizer_config.json.new"
    shutil.copyfile(path, fresh)
    os.replace(fresh, path)  # same bytes under a new inode


# Changes made between the loader guard's check and the processor hook; None: the folder is left as it is.
CHANGES: Dict[str, Callable[[Path], None]] = {
    "unchanged": lambda folder: None,
    "file added": lambda folder: (folder / "notes.txt").write_text("added\n"),
    "file removed": lambda folder: (folder / "generation_config.json").unlink(),
    "weights rewritten in place": _rewrite_weights,
    "config.json edited": _edit_config,
    "file replaced": _replace_tokenizer_config,
    "header corrupted": corrupt_header,
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Dict[str, Path]:
    """Settled tiny checkpoints: "good", "bad" (a corrupted header) and one per CHANGES kind."""
    root = tmp_path_factory.mktemp("checked_once")
    good = build_tiny_checkpoint(root / "good", layout="mlx")
    out = {"good": good, "bad": Path(shutil.copytree(good, root / "bad"))}
    corrupt_header(out["bad"])
    for n, kind in enumerate(CHANGES):
        out[kind] = Path(shutil.copytree(good, root / f"change{n}"))
    settle()
    return out


def test_mlx_vlm_load_reads_the_headers_once(folders):
    import mlx_vlm

    assert header_reads(folders["good"], mlx_vlm.load, str(folders["good"])) == 1


def test_cli_generate_reads_the_headers_once(folders):
    results = []
    assert header_reads(folders["good"], lambda: results.append(generate_cli(folders["good"]))) == 1
    code, stderr = results[0]
    assert code == 0, stderr


def test_every_load_checks_again_and_validate_checkpoint_every_call(folders):
    import mlx_vlm

    good = folders["good"]
    assert [header_reads(good, mlx_vlm.load, str(good)) for _ in range(2)] == [1, 1]
    assert [header_reads(good, validate_checkpoint, good) for _ in range(2)] == [1, 1]


def test_folder_changed_after_the_loader_guard_is_checked_again(folders):
    # One thread per folder: a thread hands its load's verdict on to its own next step only.
    lanes = {kind: ThreadPoolExecutor(max_workers=1) for kind in CHANGES}
    try:
        for kind in CHANGES:
            assert header_reads(folders[kind], in_lane, lanes[kind], load_model, folders[kind]) == 1
        for kind, change in CHANGES.items():
            change(folders[kind])
        settle()  # old again: only the entries' stats can tell
        for kind in CHANGES:
            folder = folders[kind]
            if kind == "header corrupted":
                with pytest.raises(CheckpointError) as usual:
                    validate_checkpoint(folder, require_weights=False)
                with pytest.raises(CheckpointError) as refused:
                    in_lane(lanes[kind], build_processor, folder)
                assert str(refused.value) == str(usual.value), kind
                assert "not a valid safetensors file" in str(refused.value)
                continue
            reads = header_reads(folder, in_lane, lanes[kind], build_processor, folder)
            assert reads == (0 if kind == "unchanged" else 1), kind
    finally:
        for lane in lanes.values():
            lane.shutdown()


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

    # The processor hook with no load before it checks; right after the guard refused, it raises
    # the guard's refusal again without a second check.
    assert header_reads(bad, refuse, "AutoProcessor alone", lambda: build_processor(bad)) == 1
    refuse("validate_checkpoint(require_weights=False)", lambda: validate_checkpoint(bad, require_weights=False))
    refuse("mlx_vlm.load", lambda: mlx_vlm.load(str(bad)))
    refuse("load_model", lambda: load_model(bad))
    assert header_reads(bad, refuse, "AutoProcessor after load_model", lambda: build_processor(bad)) == 0
    for where, err in refusals.items():
        assert type(err) is CheckpointError, where
        assert (str(err), err.folder, err.file) == (str(usual), usual.folder, usual.file), where
        assert type(err.__cause__) is type(usual.__cause__) and str(err.__cause__) == str(usual.__cause__), where
    code, stderr = generate_cli(bad)
    assert code == 2 and f"CheckpointError: {usual}" in stderr, stderr
