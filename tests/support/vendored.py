"""Import the vendored cohere_compass package through the shim, or skip with the reason."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

import pytest

from compass_compat.vendor import is_vendored, package_dir, within

PACKAGE = "mlx_vlm.models.cohere_compass"
VENDORED_DIR = package_dir()
# The vendored files' name where upstream's package is the live one (under mlx_vlm.models, so
# the package's relative imports reach the installed mlx-vlm).
STAND_IN = "mlx_vlm.models._compass_vendored"
_RAN_INIT = set()  # ids of stand-in packages whose __init__ has run


def upstream_ships() -> bool:
    """Whether the installed mlx-vlm ships its own ``models/cohere_compass`` (pip's record of the
    distribution's files; independent of the shim's own lookup, which the tests check)."""
    files = importlib.metadata.files("mlx-vlm") or []
    return any(str(f).replace("\\", "/") == "mlx_vlm/models/cohere_compass/__init__.py" for f in files)


RECORD = Path(__file__).resolve().parents[2] / "compass_compat" / "verdicts.json"


def switch_from_env(env: Optional[dict] = None) -> str:
    """COMPASS_COMPAT_IMPLEMENTATION as set (FORCE_VENDORED=1 its alias), else auto."""
    env = os.environ if env is None else env
    value = env.get("COMPASS_COMPAT_IMPLEMENTATION", "").strip().lower()
    forced = env.get("COMPASS_COMPAT_FORCE_VENDORED", "").strip().lower() in {"1", "true", "yes", "on"}
    return value or ("vendored" if forced else "auto")


# For a test that no switch can change (the vendored files by path, pure functions, or a switch the
# test sets itself): the pin's matrix run with COMPASS_COMPAT_IMPLEMENTATION=upstream would repeat it.
default_run_only = pytest.mark.skipif(
    switch_from_env() == "upstream",
    reason="the switch COMPASS_COMPAT_IMPLEMENTATION cannot change this test; it runs in this pin's "
    "default run of the matrix",
)


PINS = (
    re.search(r"ALL_ENVS=\(([^)]*)\)", (RECORD.parents[1] / "scripts" / "env" / "pins.sh").read_text()).group(1).split()
)
NEWEST_PIN = PINS[-1].split("-")[0]  # an environment is "<mlx-vlm version>[-<tag>]"


def newest_pin_default_run() -> bool:
    """Whether this is the default run of the newest pin of the matrix (scripts/env/pins.sh), where a
    check that is the same on every pin runs in full once."""
    return importlib.metadata.version("mlx-vlm") == NEWEST_PIN and switch_from_env() != "upstream"


def expected_live(switch: Optional[str] = None) -> str:
    """Which cohere_compass the documented rule makes live on this pin for ``switch`` (default:
    the environment's): upstream's where mlx-vlm ships one and the switch says upstream, or says
    auto and the record (compass_compat/verdicts.json, read as data) has every item PASS."""
    switch = switch_from_env() if switch is None else switch
    if not upstream_ships():
        return "vendored"
    if switch != "auto":
        return switch
    release = json.loads(RECORD.read_text(encoding="utf-8"))["releases"].get(importlib.metadata.version("mlx-vlm"))
    passes = release is not None and all(v == "PASS" for v in release["upstream"].values())
    return "upstream" if passes else "vendored"


def is_vendored_file(path: str) -> bool:
    return "/vendor/mlx_vlm/" in path or "/_vendor/mlx_vlm/" in path


def vendored(submodule: str = "") -> ModuleType:
    """The live vendored module ``mlx_vlm.models.cohere_compass[.submodule]``.

    On pins whose mlx-vlm ships its own cohere_compass (>= 0.6.13), upstream's is live where
    the recorded verdicts let it, or with COMPASS_COMPAT_IMPLEMENTATION=upstream (the matrix's
    0.7.10 row that keeps upstream's verdicts measured); model tests skip there, saying so.
    """
    import compass_compat  # noqa: F401  (applies the patch)

    package = importlib.import_module(PACKAGE)
    if not is_vendored_file(package.__file__ or ""):
        pytest.skip(
            "upstream mlx-vlm's cohere_compass is live in this run; the vendored model "
            "is tested in the pin's default run of the matrix",
            allow_module_level=True,
        )
    return importlib.import_module(PACKAGE + ("." + submodule if submodule else ""))


def by_path(submodule: str, package: str) -> ModuleType:
    """``submodule`` of the vendored package loaded from its file as ``<package>.<submodule>``:
    the package's ``__init__`` (mlx) does not run, and it works on pins where upstream's
    cohere_compass shadows the vendored one; another ``package`` name gives fresh module objects
    (tests that change module state use their own)."""
    _stand_in(package)
    return importlib.import_module(f"{package}.{submodule}")


def vendored_module(name: str = "") -> ModuleType:
    """The vendored module ``name`` (the package itself for ""), one copy per process: the live
    ``mlx_vlm.models.cohere_compass.<name>`` where the vendored package is live, else loaded from
    its file under STAND_IN, whose ``__init__`` (mlx, the whole model) runs only when the package
    itself is asked for."""
    if _vendored_is_live():
        return importlib.import_module(f"{PACKAGE}.{name}" if name else PACKAGE)
    stand_in = _stand_in(STAND_IN)
    if not name:
        if id(stand_in) not in _RAN_INIT:
            stand_in.__spec__.loader.exec_module(stand_in)
            _RAN_INIT.add(id(stand_in))
        return stand_in
    return importlib.import_module(f"{STAND_IN}.{name}")


def _vendored_is_live() -> bool:
    """Whether the vendored package is (or will import as) mlx_vlm.models.cohere_compass."""
    live = sys.modules.get(PACKAGE)
    if live is None and "mlx_vlm.models" in sys.modules:
        path = list(getattr(sys.modules["mlx_vlm.models"], "__path__", []))
        spec = importlib.machinery.PathFinder.find_spec(PACKAGE, path)
        return spec is not None and within(spec.origin, VENDORED_DIR)
    return is_vendored(live)


def _stand_in(package: str) -> ModuleType:
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            package, VENDORED_DIR / "__init__.py", submodule_search_locations=[str(VENDORED_DIR)]
        )
        sys.modules[package] = importlib.util.module_from_spec(spec)
    return sys.modules[package]


def implementation_under_test() -> str:
    """The cohere_compass the checklist-marked tests measure: upstream's with the switch
    COMPASS_COMPAT_IMPLEMENTATION=upstream (on a release without one, those tests fail saying
    so), else the one the documented rule makes live."""
    return "upstream" if switch_from_env() == "upstream" else expected_live()
