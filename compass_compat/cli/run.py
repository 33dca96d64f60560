"""``run -- CMD ...``: run any command with ``COMPASS_COMPAT_AUTOPATCH=1``, so every Python process
it starts in this environment is patched by the startup hook (no code change)."""

from __future__ import annotations

import argparse
import os
import sys

from ..startup import ENV as AUTOPATCH_ENV
from ..startup import PTH_NAME, installed_hooks
from .common import PROG, CliError, log


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """The ``run`` sub-parser: everything after it is the command."""
    run = subparsers.add_parser(
        "run",
        help="run a command with the patch applied in its Python processes",
        description=(
            f"Run COMMAND with {AUTOPATCH_ENV}=1: every Python process of this environment it "
            f"starts applies the patch at startup ({PTH_NAME}), without code changes. COMMAND runs "
            "with this environment's scripts first on PATH, and a bare `python` / `python3` is this "
            f"interpreter, activated or not. Example: {PROG} run -- python -m mlx_vlm.generate "
            "--model PATH --image IMG --prompt TEXT"
        ),
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")


def main(args: argparse.Namespace) -> int:
    """Replace this process with the command (so its exit code is the command's)."""
    command = args.cmd
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError(f"run needs a command, e.g. {PROG} run -- python -m mlx_vlm.generate --model PATH ...")
    if not installed_hooks():
        log(
            f"warning: {PTH_NAME} is not installed in this interpreter's site-packages, so "
            f"{AUTOPATCH_ENV}=1 has no effect here; reinstall compass-compat (pip install .)"
        )
    env = dict(os.environ)
    env[AUTOPATCH_ENV] = "1"
    # This environment, as if activated: its scripts first on PATH, `python` this interpreter.
    scripts = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join(p for p in (scripts, env.get("PATH", "")) if p)
    if command[0] in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        command = [sys.executable, *command[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError as err:
        raise CliError(f"command not found: {command[0]}") from err
    except PermissionError as err:
        raise CliError(f"cannot execute {command[0]}: {err}") from err
    return 0  # not reached: exec replaced this process
