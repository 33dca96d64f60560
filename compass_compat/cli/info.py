"""``info``: which cohere_compass implementation is live, and why; hook and cache status."""

from __future__ import annotations

import argparse
import json
import os

from compass_data.toy import default_checkpoint_path, default_checkpoint_problem

from .. import UNAVAILABLE, __version__, implementation_info
from ..startup import ENV as AUTOPATCH_ENV
from ..startup import installed_hooks
from .generate import DEMO_IMAGE


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """The ``info`` sub-parser."""
    info = subparsers.add_parser("info", help="which cohere_compass implementation is live, and why")
    info.add_argument("--json", action="store_true", help="machine-readable output")


def main(args: argparse.Namespace) -> int:
    """Print the live implementation, the startup hook and the default checkpoint's state (exit 1
    when the patch could not apply, e.g. mlx cannot load: then the reason is the first line)."""
    ckpt = default_checkpoint_path()
    problem = default_checkpoint_problem(ckpt)
    hooks = installed_hooks()
    data = {"problem": str(UNAVAILABLE)} if UNAVAILABLE is not None else dict(vars(implementation_info()))
    data.update(
        compass_compat_version=__version__,
        startup_hook=[str(h) for h in hooks],
        autopatch_env=os.environ.get(AUTOPATCH_ENV, ""),
        default_checkpoint=str(ckpt),
        default_checkpoint_state="built" if problem is None else problem,
        demo_image=str(DEMO_IMAGE),
    )
    code = 1 if UNAVAILABLE is not None else 0
    if args.json:
        print(json.dumps(data, indent=2))
        return code
    width = max(len(k) for k in data)
    for key, value in data.items():
        print(f"{key:<{width}}  {value}")
    return code
