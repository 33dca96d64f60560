"""Write one pin-bump run's checklist verdicts into the record (compass_compat/verdicts.json), or print it.

    python -m scripts.pin_bump.record WORKDIR     (in the release's environment; pin_bump.sh runs it)
    python -m scripts.pin_bump.record --show      the record as a table, one line per release

WORKDIR is pin_bump.sh's work folder: checklist-upstream.json, checklist-vendored.json (the
marked tests' verdicts, scripts/pin_bump/reduce.py) and meta.json (release, command, date,
commit). Prints the entry's one-line summary. Exit 2 when the marked tests left no verdicts for
either implementation (nothing is written).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from packaging.version import Version

from compass_compat import verdicts
from tests.support.checklist import item_names


def record(
    release: str,
    reports: Dict[str, Dict[str, Any]],
    items: Dict[str, str],
    command: str,
    date: str,
    commit: str,
    path: Optional[Path] = None,
) -> Dict[str, Any]:
    """Write ``release``'s verdicts (``reports``: implementation -> scripts/pin_bump/reduce.py's report)
    into the record at ``path``, releases in version order; returns the entry written."""
    path = verdicts.FILE if path is None else path
    data = verdicts.load(path) if path.exists() else {"about": "", "items": {}, "releases": {}}
    missing = [kind for kind in verdicts.IMPLEMENTATIONS if not reports.get(kind, {}).get("verdicts")]
    if missing:
        raise ValueError(f"no checklist verdicts for {', '.join(missing)}: the marked tests did not run")
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


def recorded_table(path: Optional[Path] = None) -> List[str]:
    """The record as a markdown table, one line per release."""
    data = verdicts.load(path)
    lines = [
        "| mlx-vlm | upstream: passes | upstream: fails | vendored | measured |",
        "| --- | --- | --- | --- | --- |",
    ]
    for release, entry in data["releases"].items():
        up, ours = entry["upstream"], entry["vendored"]
        passes = ", ".join(n for n in up if up[n] == "PASS") or "-"
        fails = ", ".join(n for n in up if up[n] == "FAIL") or "-"
        vendored = (
            f"all {len(ours)} pass"
            if all(v == "PASS" for v in ours.values())
            else "fails " + ", ".join(n for n in ours if ours[n] == "FAIL")
        )
        lines.append(
            f"| {release} | {passes} | {fails} | {vendored} | `{entry.get('command', '?')}`, {entry.get('date', '?')} |"
        )
    return lines


def main(argv: List[str]) -> int:
    if argv == ["--show"]:
        print("\n".join(recorded_table()))
        return 0
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
            print(f"[pin-bump] no verdicts recorded: the {kind} run left no verdicts ({err})", file=sys.stderr)
            return 2
    items = item_names()
    try:
        record(meta["mlx_vlm"], reports, items, meta["command"], meta["date"], meta["commit"])
    except ValueError as err:
        print(f"[pin-bump] no verdicts recorded: {err}", file=sys.stderr)
        return 2
    print(f"[pin-bump] recorded in {verdicts.FILE}: {verdicts.upstream_verdict(meta['mlx_vlm']).describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
