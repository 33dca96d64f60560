"""``server``: the installed mlx-vlm's own server (its flags), patched, serving the default
checkpoint when no ``--model`` is given."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from typing import Callable, List, NoReturn

from .. import implementation_info
from ..startup import ENV as AUTOPATCH_ENV
from .common import PROG, log
from .inputs import resolve_model


def parser() -> argparse.ArgumentParser:
    """Our own server flags; every other flag is mlx-vlm's and passes through unparsed."""
    own = argparse.ArgumentParser(
        prog=f"{PROG} server",
        add_help=False,
        allow_abbrev=False,  # an abbreviation belongs to mlx-vlm's flags
        description=(
            "Start the installed mlx-vlm's own server with the patch applied. Options not listed "
            "here (--host, --port, ...) are mlx-vlm's; they differ between releases."
        ),
    )
    own.add_argument("-h", "--help", action="store_true", help="show this help and mlx-vlm's server options")
    own.add_argument("--model", help="checkpoint folder (or Hugging Face repo id); default: the default checkpoint")
    return own


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """The ``server`` entry of the top-level help (``main`` parses the flags itself)."""
    subparsers.add_parser(
        "server",
        add_help=False,
        parents=[parser()],
        help="start mlx-vlm's server, patched (mlx-vlm's server flags)",
    )


def main(argv: List[str]) -> int:
    """Run mlx-vlm's server in this process with the flags after ``server``."""
    args, rest = parser().parse_known_args(argv)
    if not args.help:
        # A bad path fails here, with a message, not inside the server; none given: the default
        # checkpoint, as `generate` (mlx-vlm's server would otherwise load nothing until asked).
        ref, is_default = resolve_model(args.model)
        rest = ["--model", ref, *rest]
        if is_default:
            log(f"serving the default checkpoint {ref} (a toy: pass --model for a real one)")
    module = importlib.import_module("mlx_vlm.server")  # fastapi and uvicorn are mlx-vlm's dependencies
    if args.help:
        parser().print_help()
        print(f"\nEverything else goes to mlx-vlm {implementation_info().mlx_vlm_version}'s server:\n", flush=True)
        sys.argv = ["mlx_vlm.server", "--help"]
        module.main()  # argparse prints mlx-vlm's options and exits
        return 0
    info = implementation_info()
    log(f"cohere_compass: {info.implementation} live ({info.reason})")
    # Children spawned by uvicorn --reload re-import the app: the startup hook patches them.
    os.environ[AUTOPATCH_ENV] = "1"
    sys.argv = ["mlx_vlm.server", *rest]
    _exit_after(module.main)


def _exit_after(serve: Callable[[], None]) -> NoReturn:
    """Run ``serve`` (uvicorn), then end the process with its exit code: 0 after Ctrl+C or SIGTERM.

    uvicorn shuts down gracefully on either signal, then raises it again once it returns; SIGTERM's
    default action would end the process with 143, so it raises ``SystemExit(0)`` here instead."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        serve()
        code = 0
    except KeyboardInterrupt:
        code = 0
    except SystemExit as stop:  # uvicorn's exit when it cannot start (3, an int on every pin), or SIGTERM's 0
        code = stop.code if isinstance(stop.code, int) else 0
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: it aborts (std::terminate) in MLX's thread-local destructors (docs/hosts.md).
    os._exit(code)
