"""Pin-bump checklist: can the vendored ``cohere_compass`` be deleted at this mlx-vlm pin?

Run it in the environment of the mlx-vlm pin you are considering::

    python -m scripts.checklist [--json] [--implementation upstream|vendored]

Every item of ``CHECKLIST.md`` is checked automatically against the installed mlx-vlm and
reported as PASS or FAIL with its evidence (numbers, or the error). Exit status: 0 when every
item passes (upstream's package can replace the vendored copy), 1 when any item fails, 2 when
the checklist could not run (e.g. the reference fixtures are missing).

``--implementation upstream`` (the default) checks mlx-vlm's own ``cohere_compass``; items that
need it FAIL with "no upstream cohere_compass" on pins that do not ship it (before 0.6.13).
``--implementation vendored`` runs the same items against compass-compat's vendored package
(made live the documented way, ``apply_patch(force_vendored=True)``); that is how the tests show
the checks are meaningful. Item 7 imports the vendored package whole: in upstream mode beside
upstream's, under compass_compat.vendor's name for it, so both implementations are live in one
process.

Workshop code: it runs from a repository checkout (``python -m scripts.checklist``), never from
the wheel. Ground truth is the reference fixtures recorded from transformers (the checkout's
``tests/fixtures``, or ``--fixtures DIR``).

Models are driven the way mlx-vlm drives them: ``mlx_vlm.load`` (model and processor, the
processor through ``AutoProcessor``), ``Model.__call__`` / ``get_input_embeddings`` for logits
and positions, ``mlx_vlm.generate.generate_step`` for greedy ids on the reference inputs and
``mlx_vlm.stream_generate`` for the whole prompt path (template text -> processor -> model).
Items 5 and 6 run in fresh interpreters that never import compass_compat (upstream mode), so
they see mlx-vlm exactly as a host without the shim does. Nothing is downloaded.

Note: running the checklist changes the process's compass-compat patch state (it selects the
implementation under test); it is meant to run as its own process.

The package: ``report`` (items, verdicts, the table and JSON), ``target`` (which implementation
is live), ``harness`` (fixtures, checkpoints, driving a model), ``checks/`` (one module per kind
of check), ``probes/`` (the scripts items 5 and 6 run in a fresh interpreter), ``runner`` and the
command line (``__main__``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from .checks.image_files import preprocessor_probe, smart_resize
from .checks.package import external_imports
from .harness import Reference, default_fixtures_dir
from .report import (
    EXIT_COULD_NOT_RUN,
    EXIT_FAIL,
    EXIT_PASS,
    FAIL,
    IMPLEMENTATIONS,
    ITEM_NUMBERS,
    ITEMS,
    PASS,
    UPSTREAM,
    VENDORED,
    CouldNotRun,
    Item,
    ItemResult,
    Report,
)
from .runner import run_checklist
from .target import FIRST_UPSTREAM_RELEASE, MODEL_TYPE, PACKAGE, Target, select_implementation, within

# The probe's name when it was private to the one-file checklist (tests/test_pixel_bounds.py uses it).
_preprocessor_probe = preprocessor_probe


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line (``__main__``): print the table (or JSON) and return the exit status."""
    # Imported here: ``python -m`` runs __main__ itself, and importing it from this module first
    # would load it twice (runpy warns on stderr).
    from .__main__ import main as cli_main

    return cli_main(argv)


__all__ = [
    "EXIT_COULD_NOT_RUN",
    "EXIT_FAIL",
    "EXIT_PASS",
    "FAIL",
    "FIRST_UPSTREAM_RELEASE",
    "IMPLEMENTATIONS",
    "ITEMS",
    "ITEM_NUMBERS",
    "MODEL_TYPE",
    "PACKAGE",
    "PASS",
    "UPSTREAM",
    "VENDORED",
    "CouldNotRun",
    "Item",
    "ItemResult",
    "Reference",
    "Report",
    "Target",
    "default_fixtures_dir",
    "external_imports",
    "main",
    "preprocessor_probe",
    "run_checklist",
    "select_implementation",
    "smart_resize",
    "within",
]
