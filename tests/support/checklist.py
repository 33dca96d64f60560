"""CHECKLIST.md's items as the suite decides them: which tests carry which item, and a run's verdicts.

A test decides item N when it carries ``@pytest.mark.checklist(N, ...)`` (tests/conftest.py gives
it the markers ``checklist`` and ``checklist_N`` too, so ``-m checklist`` selects every marked test
and ``-m checklist_2`` item 2's). From a run's outcomes an item PASSes where at least one of its
tests ran and every one of them passed; a failed, errored or skipped test (a skip measured
nothing), or an item no test carried, makes it FAIL. xfail counts as the failure it marks.

The pin-bump job reads the outcomes from pytest's junit XML, where conftest.py writes each marked
test's items as the property ``checklist``: :func:`outcomes_from_junit`, then :func:`verdicts`.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

from compass_compat import verdicts as record

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
PROPERTY = "checklist"


def item_names() -> Dict[str, str]:
    """Item number (as text) -> short name, in order: the record's own list."""
    return dict(record.load()["items"])


@dataclass(frozen=True)
class Outcome:
    """One marked test's result: its id, the items it decides, passed/failed/skipped, and why."""

    test: str
    items: Tuple[str, ...]
    outcome: str
    message: str = ""


def verdicts(outcomes: Iterable[Outcome]) -> Dict[str, Dict[str, str]]:
    """Item -> {"verdict": PASS|FAIL, "evidence": one line}, for every item of the record."""
    by_item: Dict[str, List[Outcome]] = {n: [] for n in item_names()}
    for outcome in outcomes:
        for n in outcome.items:
            by_item.setdefault(n, []).append(outcome)
    out: Dict[str, Dict[str, str]] = {}
    for n, runs in by_item.items():
        bad = [o for o in runs if o.outcome != PASSED]
        if not runs:
            out[n] = {"verdict": "FAIL", "evidence": "no test carries this item in this run (no verdict)"}
        elif bad:
            out[n] = {
                "verdict": "FAIL",
                "evidence": f"{len(bad)}/{len(runs)} tests not passed: "
                + "; ".join(f"{o.test} {o.outcome.upper()}: {o.message}" for o in bad),
            }
        else:
            out[n] = {"verdict": "PASS", "evidence": f"{len(runs)} tests passed"}
    return out


def outcomes_from_junit(path: Path) -> List[Outcome]:
    """The marked tests of a pytest ``--junitxml`` file (those with a ``checklist`` property)."""
    found = []
    for case in ET.parse(path).getroot().iter("testcase"):
        items = [p.get("value", "") for p in case.iter("property") if p.get("name") == PROPERTY]
        if not items:
            continue
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = PASSED, ""
        for tag, kind in (("failure", FAILED), ("error", FAILED), ("skipped", SKIPPED)):
            node = case.find(tag)
            if node is not None:
                outcome = kind
                message = " ".join((node.get("message") or node.text or "").split())[:300]
                if tag == "skipped" and node.get("type") == "pytest.xfail":
                    outcome = FAILED  # an expected failure is still a failure of the item
                break
        found.append(Outcome(test, tuple(items[0].split(",")), outcome, message))
    return found
