"""Shared fixtures: the tiny checkpoint in both layouts, the recorded reference, the test images."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib

import pytest

from compass_data.tiny import build_tiny_checkpoint
from tests.support import checklist
from tests.support.recorded import ReferenceFixtures

IMAGES_DIR = pathlib.Path(__file__).resolve().parent / "fixtures" / "images"


@pytest.fixture(scope="session")
def tiny_ckpt_original(tmp_path_factory) -> pathlib.Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_original"), layout="original")


@pytest.fixture(scope="module")
def model(tiny_ckpt_original):
    """The tiny checkpoint through mlx-vlm's ``load_model``, one per test module (a module that
    needs another model defines its own ``model``)."""
    from mlx_vlm.utils import load_model

    return load_model(tiny_ckpt_original)


@pytest.fixture(scope="session")
def tiny_ckpt_mlx(tmp_path_factory) -> pathlib.Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mlx"), layout="mlx")


@pytest.fixture(scope="session")
def reference() -> ReferenceFixtures:
    return ReferenceFixtures()


@pytest.fixture(scope="session")
def fixture_images() -> dict:
    """File name -> path of the synthetic PNGs the reference cases use."""
    return {p.name: p for p in sorted(IMAGES_DIR.glob("*.png"))}


@pytest.fixture(scope="session", autouse=True)
def mlx_vlm_cache_home(tmp_path_factory):
    """mlx-vlm's automatic prefix cache keeps a disk tier under ``$MLX_VLM_CACHE_HOME`` (default
    ~/.cache/mlx-vlm), keyed by prompt tokens: kept there, one run's blocks (or another
    checkpoint's, with the same tokenizer) would be served to the next. Servers inherit it."""
    old = os.environ.get("MLX_VLM_CACHE_HOME")
    os.environ["MLX_VLM_CACHE_HOME"] = str(tmp_path_factory.mktemp("mlx_vlm_cache"))
    yield
    if old is None:
        os.environ.pop("MLX_VLM_CACHE_HOME", None)
    else:
        os.environ["MLX_VLM_CACHE_HOME"] = old


def pytest_addoption(parser):
    parser.addoption(
        "--checklist-measure",
        action="store_true",
        help="measure the checklist items (the pin-bump job): no expectations from compass_compat/verdicts.json",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "reference: compares with the oracle live; runs only where torch is installed, the matrix's reference "
        "environment (scripts/env/pins.sh REFERENCE_ENV, `-m reference`)",
    )
    config.addinivalue_line(
        "markers",
        "checklist(*items): the test decides CHECKLIST.md item(s) for the live cohere_compass (`-m checklist`, "
        "`-m checklist_N`; tests/support/checklist.py)",
    )
    for n, name in checklist.item_names().items():
        config.addinivalue_line("markers", f"checklist_{n}: decides CHECKLIST.md item {n} ({name})")
    _CHECKLIST.update(outcomes={}, expected=())


# This run's marked tests (test id -> checklist.Outcome), what the record expects, and what differs.
_CHECKLIST: dict = {}
_RANK = {checklist.PASSED: 0, checklist.SKIPPED: 1, checklist.FAILED: 2}


def marked_items(item) -> tuple:
    """The checklist items a test decides, as text, in order."""
    return tuple(sorted({str(n) for mark in item.iter_markers("checklist") for n in mark.args}, key=int))


def recorded_expectation(config):
    """(implementation under test, its recorded verdicts at this release) or None: none recorded, or
    the run measures (``--checklist-measure``)."""
    if config.getoption("--checklist-measure"):
        return None
    from compass_compat import verdicts
    from tests.support.vendored import implementation_under_test

    release = verdicts.load()["releases"].get(importlib.metadata.version("mlx-vlm"))
    if release is None:
        return None
    kind = implementation_under_test()
    return kind, release[kind]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: checklist_N is added here
def pytest_collection_modifyitems(config, items):
    """Marked tests get ``checklist_N`` markers and a junit property naming their items; where the record
    says the implementation under test fails every item a test decides, the test is an expected failure."""
    if importlib.util.find_spec("torch") is None:
        skip = pytest.mark.skip(
            reason="runs in the reference environment (with torch: scripts/env/pins.sh REFERENCE_ENV)"
        )
        for item in items:
            if item.get_closest_marker("reference"):
                item.add_marker(skip)
    expected = recorded_expectation(config) if any(marked_items(item) for item in items) else None
    _CHECKLIST["expected"] = expected or ()
    for item in items:
        numbers = marked_items(item)
        if not numbers:
            continue
        for n in numbers:
            item.add_marker(getattr(pytest.mark, f"checklist_{n}"))
        item.user_properties.append((checklist.PROPERTY, ",".join(numbers)))
        if expected and all(expected[1].get(n) == "FAIL" for n in numbers):
            item.add_marker(
                pytest.mark.xfail(
                    reason=f"compass_compat/verdicts.json: {expected[0]} fails item(s) {', '.join(numbers)} here",
                    strict=False,
                )
            )


def pytest_runtest_logreport(report):
    """Each marked test's worst phase (an xfail is the failure it marks)."""
    numbers = dict(report.user_properties).get(checklist.PROPERTY)
    if not numbers:
        return
    if report.failed or (report.skipped and hasattr(report, "wasxfail")):
        outcome = checklist.FAILED
    elif report.skipped:
        outcome = checklist.SKIPPED
    else:
        outcome = checklist.PASSED
    outcomes = _CHECKLIST["outcomes"]
    previous = outcomes.get(report.nodeid)
    if previous is None or _RANK[outcome] > _RANK[previous.outcome]:
        crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
        message = "" if outcome == checklist.PASSED else " ".join(str(crash or report.longrepr or "").split())[:300]
        outcomes[report.nodeid] = checklist.Outcome(report.nodeid, tuple(numbers.split(",")), outcome, message)


def pytest_sessionfinish(session):
    """The items this run decided must have the recorded verdicts: a changed verdict fails the run."""
    expected = _CHECKLIST.get("expected", ())
    outcomes = list(_CHECKLIST.get("outcomes", {}).values())
    if not expected or not outcomes:
        return
    kind, recorded = expected
    ran = {n for o in outcomes for n in o.items}
    measured = checklist.verdicts(outcomes)
    changed = {n: measured[n] for n in sorted(ran, key=int) if measured[n]["verdict"] != recorded.get(n)}
    if changed:
        _CHECKLIST["changed"] = (kind, recorded, changed)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if "changed" not in _CHECKLIST:
        return
    kind, recorded, changed = _CHECKLIST.pop("changed")
    terminalreporter.section("checklist verdicts differ from compass_compat/verdicts.json", red=True)
    for n, got in changed.items():
        terminalreporter.line(f"item {n}: {kind} {got['verdict']} (recorded {recorded.get(n)}): {got['evidence']}")
    terminalreporter.line(
        "look at the evidence, then fix the code or record the release again: bash scripts/pin_bump/pin_bump.sh "
        + importlib.metadata.version("mlx-vlm")
    )
