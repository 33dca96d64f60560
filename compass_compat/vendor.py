"""Where the vendored ``cohere_compass`` tree is, and its modules, each loaded once per process.

A leaf module (the standard library and :mod:`compass_compat.errors` only): the shim and the
checkpoint checks (and the checklist's tests) find the vendored files here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any, Optional

from .errors import CompassCompatError

MODEL_TYPE = "cohere_compass"
PACKAGE = f"mlx_vlm.models.{MODEL_TYPE}"
# The vendored files' name where upstream's package is the live one (under mlx_vlm.models, so
# the package's relative imports reach the installed mlx-vlm).
STAND_IN = "mlx_vlm.models._compass_vendored"
_RAN_INIT = set()  # ids of stand-in packages whose __init__ has run


@functools.lru_cache(maxsize=1)
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


def within(path: Optional[str], directory: Path) -> bool:
    """Whether ``path`` lies under ``directory`` (links resolved); False for no path."""
    if not path:
        return False
    real, base = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([real, base]) == base


def is_vendored(module: Any) -> bool:
    """Whether ``module`` (None: no) was loaded from the vendored package's folder."""
    return module is not None and within(getattr(module, "__file__", None), package_dir())


def _package_name() -> str:
    """PACKAGE where the vendored package is (or will import as) the live one, else STAND_IN."""
    live = sys.modules.get(PACKAGE)
    if live is None and "mlx_vlm.models" in sys.modules:
        path = list(getattr(sys.modules["mlx_vlm.models"], "__path__", []))
        spec = importlib.machinery.PathFinder.find_spec(PACKAGE, path)
        if spec is not None and within(spec.origin, package_dir()):
            return PACKAGE
    return PACKAGE if is_vendored(live) else STAND_IN


def vendored_module(name: str = "") -> types.ModuleType:
    """The vendored module ``name`` (the package itself for ""), one copy per process: the live
    ``mlx_vlm.models.cohere_compass.<name>`` where the vendored package is live, else loaded from
    its file under STAND_IN, whose ``__init__`` (mlx, the whole model) runs only when the package
    itself is asked for."""
    package = _package_name()
    if package == PACKAGE:
        return importlib.import_module(f"{PACKAGE}.{name}" if name else PACKAGE)
    stand_in = _stand_in(STAND_IN)
    if not name:
        if id(stand_in) not in _RAN_INIT:
            stand_in.__spec__.loader.exec_module(stand_in)
            _RAN_INIT.add(id(stand_in))
        return stand_in
    return importlib.import_module(f"{STAND_IN}.{name}")


def file_module(name: str, package: str) -> types.ModuleType:
    """The vendored module ``name`` loaded from its file as ``<package>.<name>``, without the
    package's ``__init__``: another ``package`` name gives fresh module objects (tests that
    change module state use their own)."""
    _stand_in(package)
    return importlib.import_module(f"{package}.{name}")


def _stand_in(package: str) -> types.ModuleType:
    if package not in sys.modules:
        folder = package_dir()
        spec = importlib.util.spec_from_file_location(
            package, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        sys.modules[package] = importlib.util.module_from_spec(spec)
    return sys.modules[package]
