"""What every check shares: building its result, and the FAIL for a target that is not there."""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional

from ..harness import Context
from ..report import FAIL, Item, ItemResult

Check = Callable[[Context, Item], ItemResult]


def result(
    ctx: Context, item: Item, verdict: str, evidence: str, details: Optional[Dict[str, Any]] = None
) -> ItemResult:
    """The item's verdict, its claim phrased for the implementation under test."""
    return ItemResult(item.number, item.title_for(ctx.target.kind), verdict, evidence, details or {})


def needs_package(check: Check) -> Check:
    """``check`` FAILs with the reason, without running, where the implementation has no package."""

    @functools.wraps(check)
    def guarded(ctx: Context, item: Item) -> ItemResult:
        if not ctx.target.available:
            return result(ctx, item, FAIL, ctx.target.why_unavailable)
        return check(ctx, item)

    return guarded
