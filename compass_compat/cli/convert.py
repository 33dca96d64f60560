"""``convert``: the installed mlx-vlm's converter (its flags, e.g. ``--hf-path ... --mlx-path ...
-q --q-bits 4``), patched."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import List

from .. import implementation_info
from .common import PROG, CliError, flag_value
from .inputs import REPO_ID


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """The ``convert`` entry of the top-level help (every flag is mlx-vlm's)."""
    subparsers.add_parser(
        "convert",
        add_help=False,
        help="mlx-vlm's converter, patched (e.g. --hf-path IN --mlx-path OUT -q --q-bits 4)",
    )


def main(argv: List[str]) -> int:
    """Run mlx-vlm's converter in this process with the flags after ``convert``."""
    if "-h" in argv or "--help" in argv:
        version = implementation_info().mlx_vlm_version
        print(f"{PROG} convert: mlx-vlm {version}'s converter with the patch applied. Its options:\n", flush=True)
    else:
        hf = flag_value(argv, "--hf-path")
        if hf is None:
            raise CliError("--hf-path is required (the checkpoint folder to convert)")
        path = Path(hf).expanduser()
        if not path.is_dir() and not REPO_ID.match(hf):
            raise CliError(f"--hf-path: checkpoint folder not found: {path}")
        if path.is_dir() and not (path / "config.json").is_file():
            raise CliError(f"--hf-path: {path} has no config.json: it is not a model checkpoint folder")
    module = importlib.import_module("mlx_vlm.convert")
    sys.argv = ["mlx_vlm.convert", *argv]
    module.main()
    return 0
