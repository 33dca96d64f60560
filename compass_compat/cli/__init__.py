"""``python -m compass_compat``: mlx-vlm's generate and server with the patch applied, one
module per subcommand (``add_parser`` and ``main``); importing this package applies the patch."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .. import UNAVAILABLE, __version__
from . import generate, info, run, server
from .common import PROG, CliError

COMMANDS = {"generate": generate, "server": server, "run": run, "info": info}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand module adds its own sub-parser."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="cohere_compass (North-Micro-Vision) on the installed mlx-vlm, with the compass-compat patch applied.",
    )
    parser.add_argument("--version", action="version", version=f"compass-compat {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one subcommand; its exit code (2 with ``<prog> <command>: error: ...`` on bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    command = argv[0] if argv else ""
    try:
        if UNAVAILABLE is not None and command in COMMANDS and command != "info" and "--help" not in argv:
            raise CliError(str(UNAVAILABLE))
        if command == "server":  # its flags go to mlx-vlm untouched: it parses them itself
            return server.main(argv[1:])
        args = parser.parse_args(argv)
        command = args.command
        return COMMANDS[command].main(args)
    except CliError as err:
        print(f"{PROG} {command}: error: {err}", file=sys.stderr)
        return 2
