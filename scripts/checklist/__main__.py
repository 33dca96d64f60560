"""``python -m scripts.checklist``: print the table (or JSON) and exit 0 / 1 / 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from compass_compat import verdicts

from .report import IMPLEMENTATIONS, UPSTREAM
from .runner import run_checklist


def _parse_items(text: str) -> List[int]:
    try:
        return sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--items takes comma-separated item numbers, got {text!r}") from None


def recorded_table(path: Optional[Path] = None) -> List[str]:
    """CHECKLIST.md's table of the record, one markdown line per release."""
    data = verdicts.load(path)
    lines = [
        "| mlx-vlm | upstream: passes | upstream: fails | vendored | measured |",
        "| --- | --- | --- | --- | --- |",
    ]
    for release, entry in data["releases"].items():
        up = entry["upstream"]
        passes = ", ".join(n for n in up if up[n] == "PASS") or "-"
        fails = ", ".join(n for n in up if up[n] == "FAIL") or "-"
        ours = entry["vendored"]
        vendored = (
            f"all {len(ours)} pass"
            if all(v == "PASS" for v in ours.values())
            else "fails " + ", ".join(n for n in ours if ours[n] == "FAIL")
        )
        lines.append(
            f"| {release} | {passes} | {fails} | {vendored} | `{entry.get('command', '?')}`, {entry.get('date', '?')} |"
        )
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: print the table (or JSON) and return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.checklist",
        description="Check, at the installed mlx-vlm pin, every item that must hold before the "
        "vendored cohere_compass can be deleted (CHECKLIST.md). Exit 0: all pass; "
        "1: some fail; 2: could not run.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--recorded",
        action="store_true",
        help="print the recorded verdicts per release (compass_compat/verdicts.json: they decide which "
        "cohere_compass is live) and exit",
    )
    parser.add_argument(
        "--implementation",
        choices=IMPLEMENTATIONS,
        default=UPSTREAM,
        help="check mlx-vlm's own package (default) or the vendored one",
    )
    parser.add_argument(
        "--items", type=_parse_items, default=None, help="comma-separated item numbers to run (default: all)"
    )
    parser.add_argument(
        "--fixtures",
        type=Path,
        default=None,
        help="directory with reference/ and images/ (default: <repo>/tests/fixtures)",
    )
    args = parser.parse_args(argv)
    if args.recorded:
        print("\n".join(recorded_table()))
        return 0
    try:
        report = run_checklist(args.implementation, args.items, args.fixtures)
    except ValueError as exc:
        parser.error(str(exc))
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        print(report.table())
    if report.error is not None and not args.json:
        print(f"could not run: {report.error}", file=sys.stderr)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
