"""Write one pin-bump run's checklist verdicts into the record (compass_compat/verdicts.json).

    python -m scripts.pin_bump.record WORKDIR     (in the release's environment; pin_bump.sh runs it)

WORKDIR is pin_bump.sh's work folder: checklist-upstream.json, checklist-vendored.json and
meta.json (release, command, date, commit). Prints the entry's one-line summary. Exit 2 when the
checklist could not run for either implementation (nothing is written).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from packaging.version import Version

from compass_compat import verdicts
from scripts.checklist.report import ITEMS


def record(
    release: str,
    reports: Dict[str, Dict[str, Any]],
    items: Dict[str, str],
    command: str,
    date: str,
    commit: str,
    path: Optional[Path] = None,
) -> Dict[str, Any]:
    """Write ``release``'s verdicts (``reports``: implementation -> the checklist's ``--json``)
    into the record at ``path``, releases in version order; returns the entry written."""
    path = verdicts.FILE if path is None else path
    data = verdicts.load(path) if path.exists() else {"about": "", "items": {}, "releases": {}}
    missing = [kind for kind in verdicts.IMPLEMENTATIONS if not reports.get(kind, {}).get("verdicts")]
    if missing:
        raise ValueError(f"no checklist verdicts for {', '.join(missing)}: the checklist could not run")
    entry = {kind: {n: reports[kind]["verdicts"][n] for n in items} for kind in verdicts.IMPLEMENTATIONS}
    entry.update(command=command, date=date, commit=commit)
    data["items"] = items
    releases = {**data["releases"], release: entry}
    data["releases"] = {r: releases[r] for r in sorted(releases, key=Version)}
    path.write_text(dump(data), encoding="utf-8")
    return entry


def dump(data: Dict[str, Any]) -> str:
    """The record as JSON, one line per release's verdicts (a reviewable diff per release)."""
    releases = [
        f"  {json.dumps(release)}: {{\n"
        + ",\n".join(f"   {json.dumps(key)}: {json.dumps(value)}" for key, value in entry.items())
        + "\n  }"
        for release, entry in data["releases"].items()
    ]
    head = {k: v for k, v in data.items() if k != "releases"}
    body = json.dumps(head, indent=1)[:-2]
    return body + ',\n "releases": {\n' + ",\n".join(releases) + "\n }\n}\n"


def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    work = Path(argv[0])
    meta = json.loads((work / "meta.json").read_text(encoding="utf-8"))
    reports = {}
    for kind in verdicts.IMPLEMENTATIONS:
        try:
            reports[kind] = json.loads((work / f"checklist-{kind}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            print(f"[pin-bump] no verdicts recorded: the {kind} checklist left no JSON ({err})", file=sys.stderr)
            return 2
    items = {str(item.number): item.name for item in ITEMS}
    try:
        record(meta["mlx_vlm"], reports, items, meta["command"], meta["date"], meta["commit"])
    except ValueError as err:
        print(f"[pin-bump] no verdicts recorded: {err}", file=sys.stderr)
        return 2
    print(f"[pin-bump] recorded in {verdicts.FILE}: {verdicts.upstream_verdict(meta['mlx_vlm']).describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
