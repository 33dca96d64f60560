"""The checklist's verdicts: the record covers every pin, the marked tests reduce to verdicts, and a
planted defect flips the item it breaks.

For the defect, a pytest run in a subprocess, the vendored package live with one deliberate defect planted
(tests/support/defects.py), selects the marked tests of item 2 and an unrelated item, writes junit
XML, and the pin-bump job's reducer (tests/support/checklist.py) turns it into verdicts: the
defect's item FAILs with the evidence the reference gives, the other item keeps passing. It runs
in the newest pin's default run of the matrix (the vendored code it breaks is the same on every
pin); tests/support/defects.py holds the other defects CHECKLIST.md lists, for a run by hand.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compass_compat import verdicts as record
from tests.support import checklist
from tests.support.defects import DEFECTS, ENV
from tests.support.vendored import NEWEST_PIN, PINS, newest_pin_default_run

REPO = Path(__file__).resolve().parents[1]


def test_the_record_covers_every_item_of_every_pin():
    releases = record.load()["releases"]
    missing = {env.split("-")[0] for env in PINS} - set(releases)  # an environment is "<version>[-<tag>]"
    assert not missing, (
        f"compass_compat/verdicts.json must record every mlx-vlm version of scripts/env/pins.sh: {missing}"
    )
    for release, entry in releases.items():
        for kind in record.IMPLEMENTATIONS:
            assert list(entry[kind]) == list(checklist.item_names()), release
            assert set(entry[kind].values()) <= {"PASS", "FAIL"}, release


def marked_in_sources() -> dict:
    """Item -> the test functions whose ``@pytest.mark.checklist(...)`` names it (read with ast)."""
    found: dict = {}
    for path in sorted((REPO / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and ast.unparse(deco.func) == "pytest.mark.checklist":
                    for arg in deco.args:
                        found.setdefault(str(ast.literal_eval(arg)), []).append(f"{path.name}::{node.name}")
    return found


def test_every_item_is_decided_by_marked_tests():
    marked = marked_in_sources()
    assert sorted(marked, key=int) == list(checklist.item_names()), marked
    assert all(n.startswith("test_live_package.py") for n in marked["2"]), marked["2"]


@pytest.mark.parametrize(
    "outcomes, verdict, words",
    [
        ([("a", "passed"), ("b", "passed")], "PASS", "2 tests passed"),
        ([("a", "passed"), ("b", "failed")], "FAIL", "1/2 tests not passed"),
        ([("a", "passed"), ("b", "skipped")], "FAIL", "b SKIPPED"),  # a skip measured nothing
        ([], "FAIL", "no test carries this item"),
    ],
)
def test_an_item_passes_only_where_all_its_tests_ran_and_passed(outcomes, verdict, words):
    got = checklist.verdicts(checklist.Outcome(test, ("2",), outcome) for test, outcome in outcomes)["2"]
    assert got["verdict"] == verdict and words in got["evidence"], got


def test_junit_outcomes_keep_xfail_a_failure(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="t" name="a"><properties><property name="checklist" value="2,3"/></properties></testcase>'
        '<testcase classname="t" name="b"><properties><property name="checklist" value="3"/></properties>'
        '<skipped type="pytest.xfail" message="recorded"/></testcase>'
        '<testcase classname="t" name="c"><properties><property name="checklist" value="4"/></properties>'
        '<skipped type="pytest.skip" message="no reason"/></testcase>'
        '<testcase classname="t" name="d"/>'
        "</testsuite></testsuites>",
        encoding="utf-8",
    )
    got = {o.test: (o.items, o.outcome) for o in checklist.outcomes_from_junit(xml)}
    assert got == {"t::a": (("2", "3"), "passed"), "t::b": (("3",), "failed"), "t::c": (("4",), "skipped")}


def measured(tmp_path: Path, defect: str, selection: str) -> dict:
    """Item verdicts of the marked tests ``selection`` selects, with ``defect`` planted in the vendored package."""
    junit = tmp_path / "junit.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPASS_COMPAT_")}
    env.update(COMPASS_COMPAT_IMPLEMENTATION="vendored", **{ENV: defect})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-p", "tests.support.defects"]
        + ["-m", selection, "--checklist-measure", f"--junitxml={junit}"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env=env,
    )
    assert junit.is_file(), f"pytest exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return checklist.verdicts(checklist.outcomes_from_junit(junit))


@pytest.mark.skipif(
    not newest_pin_default_run(),
    reason=f"runs in the default run of mlx-vlm {NEWEST_PIN}, the newest pin: the vendored code it breaks is "
    "the same on every pin",
)
def test_a_sliding_window_one_key_too_wide_fails_item_2_only(tmp_path):
    assert "2" in DEFECTS["sliding_window_off_by_one"][1] and "10" not in DEFECTS["sliding_window_off_by_one"][1]
    got = measured(tmp_path, "sliding_window_off_by_one", "checklist_2 or checklist_10")
    assert got["2"]["verdict"] == "FAIL", got["2"]
    # text_short is shorter than the window and still matches; the longer prompts see one key too many.
    assert "2/3 tests not passed" in got["2"]["evidence"], got["2"]["evidence"]
    assert "text_long" in got["2"]["evidence"] and "max|dlogits|" in got["2"]["evidence"]
    assert got["10"] == {"verdict": "PASS", "evidence": "1 tests passed"}
    # Items no selected test carries have no verdict: FAIL, never PASS by default.
    assert got["5"]["verdict"] == "FAIL" and "no test carries" in got["5"]["evidence"]


def test_the_reducer_reports_exit_status_and_evidence(tmp_path):
    """scripts/pin_bump/reduce.py: 0 every item passes, 1 some fail (with the failing test's message),
    2 no verdict (no junit file, or no marked test in it)."""
    from scripts.pin_bump import reduce

    names = checklist.item_names()
    passing = "".join(
        f'<testcase classname="t" name="t{n}"><properties><property name="checklist" value="{n}"/></properties></testcase>'
        for n in names
    )
    xml = tmp_path / "all.xml"
    xml.write_text(f"<testsuites><testsuite>{passing}</testsuite></testsuites>", encoding="utf-8")
    assert reduce.report(xml, "vendored")["exit_code"] == 0
    failing = passing.replace(
        'name="t2"><properties><property name="checklist" value="2"/></properties>',
        'name="t2"><properties><property name="checklist" value="2"/></properties><failure message="double BOS"/>',
    )
    xml.write_text(f"<testsuites><testsuite>{failing}</testsuite></testsuites>", encoding="utf-8")
    got = reduce.report(xml, "upstream")
    assert got["exit_code"] == 1 and got["verdicts"]["2"] == "FAIL"
    assert "t::t2 FAILED: double BOS" in got["items"][1]["evidence"]
    assert reduce.report(tmp_path / "absent.xml", "upstream")["exit_code"] == 2
    empty = tmp_path / "empty.xml"
    empty.write_text("<testsuites><testsuite/></testsuites>", encoding="utf-8")
    assert "did not run" in reduce.report(empty, "upstream")["error"]


def test_a_release_without_an_upstream_package_fails_every_upstream_item():
    from scripts.pin_bump import reduce

    got = reduce.absent("upstream")
    assert got["verdicts"] == dict.fromkeys(checklist.item_names(), "FAIL") and got["exit_code"] == 1
    assert all("no upstream cohere_compass" in item["evidence"] for item in got["items"])
