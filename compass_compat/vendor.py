"""Where the vendored ``cohere_compass`` tree is (a leaf module: the standard library and
:mod:`compass_compat.errors` only)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Optional

from .errors import CompassCompatError

MODEL_TYPE = "cohere_compass"
PACKAGE = f"mlx_vlm.models.{MODEL_TYPE}"


@functools.lru_cache(maxsize=1)
def vendor_root() -> Path:
    """The directory holding the vendored ``mlx_vlm/models/cohere_compass`` tree: ``compass_compat/_vendor``
    in an installed wheel, ``<repo>/vendor`` in a source checkout (or editable install)."""
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
