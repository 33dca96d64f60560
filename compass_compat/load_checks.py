"""One check of a checkpoint folder per ``mlx_vlm.load`` (docs/shim.md): the processor hook takes
the loader guard's verdict, on the same thread, when no entry of the folder changed in between
(the stat is taken before the check); every load checks again."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple

from . import checkpoint_checks
from .checkpoint_checks import CheckpointError, CheckpointReport, check_folder, weights_required

# A same-size rewrite within the file system's timestamp granularity keeps a file's stat
# (FAT: 2 s; HFS+, ext3: 1 s; elsewhere a clock tick), so a verdict on a folder with an
# entry changed less than this long before is not handed on (git's "racily clean" rule).
SETTLED_NS = 2_000_000_000
_load = threading.local()  # .verdict: the last load start's _Verdict on this thread


@dataclass(frozen=True)
class _Verdict:
    folder: Tuple[str, str]  # as given (messages name it) and absolute
    fingerprint: Optional[Tuple]
    report: Optional[CheckpointReport]
    refusal: Optional[CheckpointError]


def validate_load_start(path: Any, *, require_weights: bool = True) -> CheckpointReport:
    """:func:`validate_checkpoint` for the first step of a load (the shim's loader guard): checks
    the folder and keeps the verdict for the load's next step on this thread."""
    folder = Path(os.fspath(path))
    _load.verdict = None
    fingerprint = _fingerprint(folder)
    try:
        report = check_folder(folder)
    except CheckpointError as err:
        _load.verdict = _Verdict(_spelling(folder), fingerprint, None, _again(err))
        raise
    _load.verdict = _Verdict(_spelling(folder), fingerprint, report, None)
    return weights_required(report, require_weights)


def validate_load_step(path: Any, *, require_weights: bool = True) -> CheckpointReport:
    """:func:`validate_checkpoint` for the next step of a load (the shim's processor hook): the
    verdict of the load's start on this thread (used once), if it was of this folder and no entry
    of the folder changed since (names, inodes, sizes, mtimes, ctimes); else a check now. A
    refusal is raised again as a new CheckpointError with the same message, file and cause."""
    folder = Path(os.fspath(path))
    verdict, _load.verdict = getattr(_load, "verdict", None), None
    if (
        verdict is None
        or verdict.fingerprint is None
        or verdict.folder != _spelling(folder)
        or verdict.fingerprint != _fingerprint(folder)
    ):
        # Looked up at call time, so whatever wraps validate_checkpoint sees this check too.
        return checkpoint_checks.validate_checkpoint(path, require_weights=require_weights)
    if verdict.refusal is not None:
        raise _again(verdict.refusal)
    return weights_required(verdict.report, require_weights)


def _spelling(folder: Path) -> Tuple[str, str]:
    return str(folder), os.path.abspath(folder)


def _again(err: CheckpointError) -> CheckpointError:
    again = CheckpointError(str(err), folder=err.folder, file=err.file)
    if err.__cause__ is not None:
        again.__cause__ = err.__cause__
    return again


def _stat(st: os.stat_result) -> Tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _fingerprint(folder: Path) -> Optional[Tuple]:
    """The stat of the folder and of every entry under it, links and their targets (stat calls
    only); None if the folder cannot be listed or an entry changed less than SETTLED_NS ago."""
    settled = time.time_ns() - SETTLED_NS
    try:
        root = os.path.realpath(folder), _stat(os.stat(folder))
        entries, pending = [], [""]
        while pending:
            sub = pending.pop()
            with os.scandir(folder / sub) as listing:
                for entry in listing:
                    name = os.path.join(sub, entry.name)
                    own = _stat(entry.stat(follow_symlinks=False))
                    try:
                        target = _stat(entry.stat()) if entry.is_symlink() else own
                    except OSError:
                        target = None  # a broken link: the check refuses it
                    entries.append((name, own, target))
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(name)
    except OSError:
        return None
    stats = [root[1]] + [s for _, own, target in entries for s in (own, target) if s is not None]
    if any(max(mtime, ctime) > settled for *_, mtime, ctime in stats):
        return None
    return root, tuple(sorted(entries))
