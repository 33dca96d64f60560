"""The checklist's recorded verdicts (``verdicts.json``, shipped in the package; written by
``scripts/pin_bump/record.py``): which items each mlx-vlm release's own ``cohere_compass`` passes.
:func:`apply_patch` makes upstream's live only on a release whose recorded verdict passes every item."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from .errors import CompassCompatError

FILE = Path(__file__).resolve().parent / "verdicts.json"
IMPLEMENTATIONS = ("upstream", "vendored")
VERDICTS = ("PASS", "FAIL")


@dataclass(frozen=True)
class Verdict:
    """What the record says of one release's own ``cohere_compass``.

    Attributes:
        release: the mlx-vlm version looked up.
        recorded: whether the record has a verdict for it.
        failing: the items upstream's package fails there, as (number, claim).
        measured: how the verdict was measured (command, date, commit), or "".
    """

    release: str
    recorded: bool
    failing: Tuple[Tuple[int, str], ...] = ()
    measured: str = ""

    def describe(self) -> str:
        """One sentence: what the record says, or how to record a verdict."""
        if not self.recorded:
            return (
                f"no verdict recorded for mlx-vlm {self.release}: run "
                f"`bash scripts/pin_bump/pin_bump.sh {self.release}` to record one"
            )
        if not self.failing:
            return f"mlx-vlm {self.release}'s own cohere_compass passes every checklist item ({self.measured})"
        items = ", ".join(f"{n} ({claim})" for n, claim in self.failing)
        return f"mlx-vlm {self.release}'s own cohere_compass fails checklist item(s) {items} ({self.measured})"


def _fail(path: Path, message: str) -> CompassCompatError:
    return CompassCompatError(
        f"{path}: {message}; reinstall compass-compat (the file ships with it), or rewrite it with "
        "scripts/pin_bump/pin_bump.sh"
    )


def load(path: Optional[Path] = None) -> Dict[str, Any]:
    """The record (``path``, default :data:`FILE`), checked: ``{"items": {n: name}, "releases": {release: entry}}``."""
    path = FILE if path is None else path
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _fail(path, "missing") from None
    except (OSError, ValueError) as err:
        raise _fail(path, f"unreadable ({err})") from None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("items"), dict)
        or not isinstance(data.get("releases"), dict)
    ):
        raise _fail(path, "not a record (it needs 'items' and 'releases' objects)")
    items = data["items"]
    for release, entry in data["releases"].items():
        if not isinstance(entry, dict):
            raise _fail(path, f"release {release!r} is not an object")
        for kind in IMPLEMENTATIONS:
            verdicts = entry.get(kind)
            if not isinstance(verdicts, dict) or set(verdicts) != set(items):
                raise _fail(path, f"release {release!r} needs {kind} verdicts for items {', '.join(items)}")
            if any(v not in VERDICTS for v in verdicts.values()):
                raise _fail(path, f"release {release!r}: {kind} verdicts must be PASS or FAIL")
    return data


def upstream_verdict(release: str, path: Optional[Path] = None) -> Verdict:
    """The recorded verdict on mlx-vlm ``release``'s own ``cohere_compass``."""
    data = load(path)
    entry = data["releases"].get(release)
    if entry is None:
        return Verdict(release, recorded=False)
    failing = tuple(
        (int(n), data["items"][n])
        for n, v in sorted(entry["upstream"].items(), key=lambda kv: int(kv[0]))
        if v == "FAIL"
    )
    measured = f"`{entry.get('command', '?')}` on {entry.get('date', '?')}"
    return Verdict(release, recorded=True, failing=failing, measured=measured)


def live_for(release: str, upstream_ships: bool, path: Optional[Path] = None) -> Tuple[str, Optional[Verdict]]:
    """The rule: (``"upstream"`` or ``"vendored"``, the verdict behind it; None where mlx-vlm
    ships no ``cohere_compass``, so nothing is decided). The record is read and checked either
    way: a damaged one fails on every mlx-vlm, not only where it decides."""
    load(path)
    if not upstream_ships:
        return "vendored", None
    verdict = upstream_verdict(release, path)
    return ("upstream" if verdict.recorded and not verdict.failing else "vendored"), verdict
