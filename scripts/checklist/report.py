"""The checklist's items and what a run reports: verdicts, evidence, the table and the JSON."""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

PASS, FAIL = "PASS", "FAIL"
# The implementations a report can be about (target.py makes one of them live).
UPSTREAM, VENDORED = "upstream", "vendored"
IMPLEMENTATIONS = (UPSTREAM, VENDORED)
EXIT_PASS, EXIT_FAIL, EXIT_COULD_NOT_RUN = 0, 1, 2


@dataclass(frozen=True)
class Item:
    """One checklist item: its number, its claim, why it matters, and a short name (the
    recorded verdicts, compass_compat/verdicts.json, name items by it).

    ``title`` names the implementation as ``{impl}`` (see :meth:`title_for`).
    """

    number: int
    title: str
    why: str
    name: str

    def title_for(self, implementation: str) -> str:
        """The claim, about ``implementation`` ("upstream" or "vendored")."""
        return self.title.format(impl="the vendored copy" if implementation == VENDORED else implementation)


# Numbers and titles are CHECKLIST.md's; its expected-verdicts block is keyed by these numbers.
ITEMS: Tuple[Item, ...] = (
    Item(1, "{impl} ships cohere_compass", "without it mlx-vlm cannot load the model at all", "ships cohere_compass"),
    Item(
        2,
        "{impl}'s text path matches the reference (prefill logits within 1e-4, 32 greedy ids)",
        "a wrong window, norm or rope silently degrades every answer",
        "text path",
    ),
    Item(
        3,
        "{impl}'s image path matches the reference (pixels, image tokens, positions, logits, greedy ids; "
        "image files honoured; no double BOS)",
        "wrong pixels or MRoPE positions silently degrade every image answer",
        "image path",
    ),
    Item(
        4,
        "{impl} has a public encode_image; its cached replay logits identical to the uncached path (deepstack included)",
        "hosts that cache image features would silently lose the deepstack residuals",
        "encode_image replay",
    ),
    Item(
        5,
        "MODEL_CONFIG registers cohere_compass ({impl})",
        "an unregistered model type silently drops the images from the prompt",
        "MODEL_CONFIG entry",
    ),
    Item(
        6,
        "AutoProcessor builds {impl}'s processor for a checkpoint folder without torch",
        "hosts without torch could not load the model",
        "torch-free processor",
    ),
    Item(
        7,
        "the rotary helpers (and every other mlx-lm / mlx-vlm name) the vendored code imports exist at this pin",
        "the vendored copy itself would fail to import",
        "vendored imports",
    ),
    Item(
        8,
        "a quantized checkpoint (4-bit, group 64) loads and generates through {impl}",
        "published MLX conversions are quantized",
        "quantized checkpoint",
    ),
    Item(
        9,
        "both weight layouts (original and MLX) load through {impl}",
        "CohereLabs checkpoints and MLX conversions use different key names",
        "both weight layouts",
    ),
    Item(
        10,
        "a sampled vocabulary-padding id (past the tokenizer) streams as the reference decodes it: "
        "no text, no error ({impl})",
        "vocab_size exceeds the tokenizer (262144 vs 255035): one sampled padding id ends the stream "
        "with an IndexError",
        "vocabulary-padding ids",
    ),
    Item(
        11,
        "{impl}'s video path matches the reference (timestamped prompt ids, pixels, grids, positions, "
        "logits, greedy ids)",
        "a video prompt without its per-patch timestamps, or video tokens embedded as text, silently "
        "degrades every video answer",
        "video path",
    ),
    Item(
        12,
        "every feature this mlx-vlm offers (generation keywords, server flags and routes, python -m "
        "modules) is listed in docs/features.md",
        "a feature a new release adds would reach users of this model untested",
        "feature surface listed",
    ),
)
ITEM_NUMBERS = tuple(item.number for item in ITEMS)


class CouldNotRun(RuntimeError):
    """The checklist could not run at all (exit status 2): no verdict is possible."""


@dataclass
class ItemResult:
    """Verdict of one item: PASS/FAIL, one line of evidence, and per-case details for --json."""

    item: int
    title: str
    verdict: str
    evidence: str
    details: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    """Everything one checklist run found."""

    implementation: str
    mlx_vlm_version: str
    live_package: Optional[str]
    fixtures: Optional[str]
    items: List[ItemResult]
    seconds: float
    error: Optional[str] = None

    @property
    def exit_code(self) -> int:
        """0 all pass, 1 any fails, 2 could not run."""
        if self.error is not None or not self.items:
            return EXIT_COULD_NOT_RUN
        return EXIT_PASS if all(r.verdict == PASS for r in self.items) else EXIT_FAIL

    def verdicts(self) -> Dict[str, str]:
        """Item number (as a string) -> PASS/FAIL."""
        return {str(r.item): r.verdict for r in self.items}

    def to_json(self) -> Dict[str, Any]:
        """The report as printed by ``--json``."""
        return {
            "implementation": self.implementation,
            "mlx_vlm_version": self.mlx_vlm_version,
            "live_package": self.live_package,
            "fixtures": self.fixtures,
            "exit_code": self.exit_code,
            "error": self.error,
            "seconds": round(self.seconds, 1),
            "verdicts": self.verdicts(),
            "items": [asdict(r) for r in self.items],
        }

    def table(self, width: int = 110) -> str:
        """The human-readable table: item, verdict, claim and evidence."""
        lines = [
            f"compass-compat pin-bump checklist: mlx-vlm {self.mlx_vlm_version}, implementation {self.implementation}",
            f"  package: {self.live_package or '-'}",
            f"  fixtures: {self.fixtures or '-'}",
        ]
        if self.error is not None:
            lines.append(f"COULD NOT RUN: {self.error}")
            lines.append("exit 2")
            return "\n".join(lines)
        lines.append("")
        lines.append(f"{'item':<5} {'verdict':<8} check / evidence")
        indent = " " * 15
        for r in self.items:
            lines.append(f"{r.item:<5} {r.verdict:<8} {r.title}")
            for part in r.evidence.split("\n"):
                lines.extend(textwrap.wrap(part, width, initial_indent=indent, subsequent_indent=indent + "  "))
        passed = sum(r.verdict == PASS for r in self.items)
        lines.append("")
        failed = ", ".join(str(r.item) for r in self.items if r.verdict != PASS)
        if self.implementation == VENDORED:
            tail = (
                "the vendored package passes every item"
                if not failed
                else f"the vendored package fails item(s) {failed}"
            )
        elif self.exit_code == EXIT_PASS:
            tail = "every item passes: the vendored copy can be deleted at this pin"
        else:
            tail = f"item(s) {failed} fail: keep the vendored copy"
        lines.append(f"{passed}/{len(self.items)} items pass; {tail} (exit {self.exit_code}) [{self.seconds:.0f}s]")
        return "\n".join(lines)


def fmt(x: float) -> str:
    """A number as evidence shows it: two significant digits, exact zero as "0"."""
    return f"{x:.2g}" if x != 0 else "0"


def error_text(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line of evidence, cut to ``limit`` characters."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
