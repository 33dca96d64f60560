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
from typing import List

from compass_compat import verdicts
from compass_compat.checklist.report import ITEMS


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
        verdicts.record(meta["mlx_vlm"], reports, items, meta["command"], meta["date"], meta["commit"])
    except ValueError as err:
        print(f"[pin-bump] no verdicts recorded: {err}", file=sys.stderr)
        return 2
    print(f"[pin-bump] recorded in {verdicts.FILE}: {verdicts.upstream_verdict(meta['mlx_vlm']).describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
