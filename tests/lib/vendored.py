"""Import the vendored cohere_compass package through the shim, or skip with the reason."""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

import pytest

from compass_compat.vendor import file_module, package_dir

PACKAGE = "mlx_vlm.models.cohere_compass"
VENDORED_DIR = package_dir()


def upstream_ships() -> bool:
    """Whether the installed mlx-vlm ships its own ``models/cohere_compass`` (pip's record of the
    distribution's files; independent of the shim's own lookup, which the tests check)."""
    files = importlib.metadata.files("mlx-vlm") or []
    return any(str(f).replace("\\", "/") == "mlx_vlm/models/cohere_compass/__init__.py" for f in files)


def is_vendored_file(path: str) -> bool:
    return "/vendor/mlx_vlm/" in path or "/_vendor/mlx_vlm/" in path


def vendored(submodule: str = "") -> ModuleType:
    """The live vendored module ``mlx_vlm.models.cohere_compass[.submodule]``.

    On pins whose mlx-vlm ships its own cohere_compass (>= 0.6.13) upstream wins
    unless COMPASS_COMPAT_FORCE_VENDORED=1; the matrix runs such pins a second
    time with the switch, so model tests skip (saying so) only in the default pass.
    """
    import compass_compat  # noqa: F401  (applies the patch)

    package = importlib.import_module(PACKAGE)
    if not is_vendored_file(package.__file__ or ""):
        pytest.skip(
            "upstream mlx-vlm's cohere_compass is live on this pin; the vendored model "
            "is tested in the COMPASS_COMPAT_FORCE_VENDORED=1 pass of the matrix",
            allow_module_level=True,
        )
    return importlib.import_module(PACKAGE + ("." + submodule if submodule else ""))


def by_path(submodule: str, package: str) -> ModuleType:
    """``submodule`` of the vendored package loaded from its file as ``<package>.<submodule>``
    (``compass_compat.vendor.file_module``): the package's ``__init__`` (mlx) does not run, and
    it works on pins where upstream's cohere_compass shadows the vendored one."""
    return file_module(submodule, package)
