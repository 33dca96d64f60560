"""``server``: the installed mlx-vlm's own server (its flags), patched, serving the default
checkpoint when no ``--model`` is given."""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import signal
import sys
from types import ModuleType
from typing import Callable, List, NoReturn

from .. import implementation_info
from ..startup import ENV as AUTOPATCH_ENV
from .common import PROG, CliError, flag_value, log
from .inputs import resolve_model


def parser() -> argparse.ArgumentParser:
    """Our own server flags; every other flag is mlx-vlm's and passes through unparsed."""
    own = argparse.ArgumentParser(
        prog=f"{PROG} server",
        add_help=False,
        description=(
            "Start the installed mlx-vlm's own server with the patch applied. Options not listed "
            "here (--model, --host, --port, ...) are mlx-vlm's; they differ between releases. "
            "Without --model it serves the default checkpoint."
        ),
    )
    own.add_argument("-h", "--help", action="store_true", help="show this help and mlx-vlm's server options")
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
    model = flag_value(rest, "--model")
    if not args.help:
        # A bad path fails here, with a message, not inside the server; none given: the default
        # checkpoint, as `generate` (mlx-vlm's server would otherwise load nothing until asked).
        ref, is_default = resolve_model(model)
        if is_default:
            rest = ["--model", ref, *rest]
            log(f"serving the default checkpoint {ref} (a toy: pass --model for a real one)")
    module = _server_module()
    if not args.help:
        info = implementation_info()
        log(f"cohere_compass: {info.implementation} live ({info.reason})")
    if args.help:
        parser().print_help()
        print(f"\nEverything else goes to mlx-vlm {implementation_info().mlx_vlm_version}'s server:\n", flush=True)
        rest = ["--help"]
    else:
        # Children spawned by uvicorn --reload re-import the app: the startup hook patches them.
        os.environ[AUTOPATCH_ENV] = "1"
    if _main_forces_reload(module):
        return _legacy_server(module, rest)
    sys.argv = ["mlx_vlm.server", *rest]
    if args.help:
        module.main()  # argparse prints mlx-vlm's options and exits
        return 0
    _exit_after(module.main)


def _exit_after(serve: Callable[[], None]) -> NoReturn:
    """Run ``serve`` (uvicorn), then end the process with its exit code: 0 after Ctrl+C or SIGTERM.

    uvicorn shuts down gracefully on either signal, then raises it again once it returns; SIGTERM's
    default action would end the process with 143, so it raises ``SystemExit(0)`` here instead."""
    signal.signal(signal.SIGTERM, _exit_zero)
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


def _exit_zero(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _main_forces_reload(module: ModuleType) -> bool:
    """Whether this mlx-vlm's server ``main()`` always runs uvicorn with ``reload=True`` (0.3.x's
    does): the hook looked for is ``reload=True`` in the source of ``mlx_vlm.server.main``."""
    try:
        return "reload=True" in inspect.getsource(module.main)
    except (OSError, TypeError):  # no source to read: run main() as it is
        return False


def _server_module() -> ModuleType:
    try:
        return importlib.import_module("mlx_vlm.server")
    except ModuleNotFoundError as err:
        info = implementation_info()
        raise CliError(
            f"mlx-vlm {info.mlx_vlm_version} has no usable server (import mlx_vlm.server failed: {err}); "
            "mlx-vlm's server needs fastapi and uvicorn"
        ) from err


def _legacy_server(module: ModuleType, rest: List[str]) -> int:
    # mlx-vlm 0.3.x: main() always runs uvicorn with reload=True, which re-imports the app in
    # a child process and watches the working directory; serve the app
    # object in this process instead. Its flags are --host and --port; --model preloads.
    legacy = argparse.ArgumentParser(prog=f"{PROG} server", description="mlx-vlm 0.3.x server, patched.")
    legacy.add_argument("--host", default="0.0.0.0", help="Host for the HTTP server (default: %(default)s)")
    legacy.add_argument("--port", type=int, default=8080, help="Port for the HTTP server (default: %(default)s)")
    legacy.add_argument("--model", help="Load this model now; requests must name it in their 'model' field.")
    args = legacy.parse_args(rest)
    if args.model:
        model_ref, _ = resolve_model(args.model)
        module.get_cached_model(model_ref)
    import uvicorn

    uvicorn.run(module.app, host=args.host, port=args.port, workers=1)
    return 0
