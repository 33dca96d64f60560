"""What every subcommand uses: the program name, the user-facing error, the log line, a flag type."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

PROG = "python -m compass_compat"


class CliError(Exception):
    """A user-facing error: printed as ``<prog> <command>: error: <message>``, exit 2."""


def log(message: str) -> None:
    """A ``[compass-compat]`` line on stderr (stdout is kept for what the command produces)."""
    print(f"[compass-compat] {message}", file=sys.stderr, flush=True)


def bounded(kind: type, low: float, high: Optional[float] = None) -> Callable[[str], float]:
    """An argparse type: a ``kind`` within [low, high] (NaN refused)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if not (low <= value and (high is None or value <= high)):
            bounds = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    return parse
