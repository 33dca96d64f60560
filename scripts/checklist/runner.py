"""Running the checklist: fixtures checked, the implementation selected, each item decided."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from .checks import CHECKS, result
from .harness import Context, Reference, check_fixture_weights, default_fixtures_dir
from .report import FAIL, ITEM_NUMBERS, ITEMS, UPSTREAM, CouldNotRun, Report, error_text
from .target import select_implementation


def run_checklist(
    implementation: str = UPSTREAM,
    items: Optional[Sequence[int]] = None,
    fixtures: Optional[Path] = None,
) -> Report:
    """Run the checklist items (all by default) against ``implementation``.

    Args:
        implementation: ``"upstream"`` (mlx-vlm's own cohere_compass) or ``"vendored"``.
        items: item numbers to run (default: all).
        fixtures: the directory holding ``reference/`` and ``images/`` (default: the
            repository's ``tests/fixtures`` next to this package).

    Returns:
        A :class:`Report`; ``report.exit_code`` is 0/1/2 as the command's. A failure to run at
        all (missing fixtures, the implementation cannot be made live) is reported with
        ``error`` set, never raised.
    """
    start = time.monotonic()
    wanted = list(ITEM_NUMBERS if items is None else items)
    unknown = sorted(set(wanted) - set(ITEM_NUMBERS))
    if unknown:
        raise ValueError(f"unknown checklist item(s) {unknown}; items are {list(ITEM_NUMBERS)}")
    fixtures_dir = Path(fixtures) if fixtures is not None else default_fixtures_dir()
    version, live = "unknown", None
    try:
        from compass_compat._patch import _mlx_vlm_version

        version = _mlx_vlm_version()
        reference = Reference(fixtures_dir)
        check_fixture_weights(reference)
        target = select_implementation(implementation)
        live = str(target.package_dir) if target.package_dir else None
        results = []
        with tempfile.TemporaryDirectory(prefix="compass-checklist-") as tmp:
            ctx = Context(target, reference, Path(tmp))
            for item in ITEMS:
                if item.number not in wanted:
                    continue
                try:
                    results.append(CHECKS[item.number](ctx, item))
                except CouldNotRun:
                    raise
                except Exception as exc:  # an item that crashes FAILS, with the error as its evidence
                    results.append(result(ctx, item, FAIL, error_text(exc, 600)))
    except CouldNotRun as exc:
        return Report(implementation, version, live, str(fixtures_dir), [], time.monotonic() - start, str(exc))
    return Report(implementation, version, live, str(fixtures_dir), results, time.monotonic() - start)
