"""compass_compat's self-contained modules, imported without the package's ``__init__``.

``import compass_compat`` patches mlx-vlm; the reference scripts must not depend on the shim,
so they import ``tiny``, ``shapes``, ``toy`` and ``weight_tree`` through a stand-in package
(``_compass_compat_unpatched``) whose path is compass_compat's folder: relative imports between
those modules work, and the package's ``__init__`` never runs.
"""

from __future__ import annotations

import importlib
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
_NAME = "_compass_compat_unpatched"


def module(name: str) -> types.ModuleType:
    """``compass_compat.<name>`` without the patch, e.g. ``module("tiny")``."""
    if _NAME not in sys.modules:
        package = types.ModuleType(_NAME)
        package.__path__ = [str(ROOT / "compass_compat")]
        sys.modules[_NAME] = package
    return importlib.import_module(f"{_NAME}.{name}")
