"""Where the vendored ``cohere_compass`` tree is, and its modules loaded without the package.

A leaf module (the standard library and :mod:`compass_compat.errors` only): the shim, the
checkpoint checks and the workshop's checklist all find the vendored files here.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

from .errors import CompassCompatError

MODEL_TYPE = "cohere_compass"
_STAND_IN = "compass_compat._vendored_files"


def vendor_root() -> Path:
    """The directory holding the vendored ``mlx_vlm/models/cohere_compass`` tree.

    An installed wheel carries it as ``compass_compat/_vendor``; a source
    checkout (or editable install) has it at ``<repo>/vendor``.
    """
    here = Path(__file__).resolve().parent
    candidates = (here / "_vendor", here.parent / "vendor")
    for root in candidates:
        if (root / "mlx_vlm" / "models" / MODEL_TYPE / "__init__.py").is_file():
            return root
    raise CompassCompatError(
        "compass-compat cannot find its vendored cohere_compass package; looked in "
        + " and ".join(str(c / "mlx_vlm" / "models" / MODEL_TYPE) for c in candidates)
    )


def package_dir() -> Path:
    """``<vendor>/mlx_vlm/models/cohere_compass``."""
    return vendor_root() / "mlx_vlm" / "models" / MODEL_TYPE


def file_module(name: str, package: str = _STAND_IN) -> types.ModuleType:
    """The vendored module ``name`` loaded from its file, without the package's ``__init__``
    (which imports mlx and the whole model), whichever ``cohere_compass`` is live.

    The modules load inside a stand-in package called ``package`` whose path is the vendored
    folder, so their relative imports of each other resolve there; another ``package`` name
    gives fresh module objects (tests that change module state use their own).
    """
    if package not in sys.modules:
        stand_in = sys.modules[package] = types.ModuleType(package)
        stand_in.__path__ = [str(package_dir())]
    return importlib.import_module(f"{package}.{name}")
