"""compass-compat: cohere_compass (Cohere North-Micro-Vision) for mlx-vlm releases that predate it.

``import compass_compat`` patches the installed mlx-vlm (:func:`apply_patch` says which
``cohere_compass`` is live; :func:`implementation_info` says why). Importing never imports torch."""

import sys
from typing import Optional

from ._patch import (
    FORCE_ENV,
    IMPLEMENTATION_ENV,
    ImplementationInfo,
    apply_patch,
    implementation_info,
    is_compass_checkpoint,
    remove_patch,
)
from .errors import CompassCompatError
from .vendor import vendor_root

__version__ = "0.1.0"

__all__ = [
    "FORCE_ENV",
    "IMPLEMENTATION_ENV",
    "CompassCompatError",
    "ImplementationInfo",
    "apply_patch",
    "implementation_info",
    "is_compass_checkpoint",
    "remove_patch",
    "vendor_root",
]


def _running_the_cli() -> bool:
    """Whether this interpreter was started as ``python -m compass_compat ...``."""
    argv = getattr(sys, "orig_argv", [])
    return any(a == "-m" and b in ("compass_compat", "compass_compat.cli") for a, b in zip(argv, argv[1:]))


# Why the patch could not apply, for the command line: its --help and info still run, every
# other command says it in one line. Importing the package anywhere else raises.
UNAVAILABLE: Optional[CompassCompatError] = None
try:
    apply_patch()
except CompassCompatError as error:
    if not _running_the_cli():
        raise error.with_traceback(None) from None  # its message says it all: no inner frames
    UNAVAILABLE = error
