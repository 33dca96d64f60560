"""Which ``cohere_compass`` is measured: mlx-vlm's own (upstream) or compass-compat's vendored copy."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from compass_compat.vendor import within

from .report import IMPLEMENTATIONS, UPSTREAM, VENDORED, CouldNotRun

MODEL_TYPE = "cohere_compass"
PACKAGE = f"mlx_vlm.models.{MODEL_TYPE}"
FIRST_UPSTREAM_RELEASE = "0.6.13"


@dataclass
class Target:
    """The implementation under test, once made live as ``mlx_vlm.models.cohere_compass``."""

    kind: str
    available: bool
    package_dir: Optional[Path]
    mlx_vlm_version: str
    why_unavailable: str = ""


def select_implementation(kind: str) -> Target:
    """Make ``kind`` the live ``mlx_vlm.models.cohere_compass`` and say where it lives.

    upstream: ``apply_patch("upstream")``, undoing an earlier patch that made the vendored
    package live (the recorded verdicts, or the switch in the environment); vendored:
    ``apply_patch("vendored")``.
    """
    if kind not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {kind!r}")
    import compass_compat

    try:
        info = compass_compat.implementation_info()
        if kind == VENDORED:
            compass_compat.apply_patch(VENDORED)
        elif info.upstream_available:
            if info.forced:
                compass_compat.remove_patch()
            compass_compat.apply_patch(UPSTREAM)
        info = compass_compat.implementation_info()
    except compass_compat.CompassCompatError as exc:
        raise CouldNotRun(f"could not select the {kind} cohere_compass: {exc}") from exc
    if kind == UPSTREAM and not info.upstream_available:
        return Target(
            kind,
            False,
            None,
            info.mlx_vlm_version,
            f"no upstream cohere_compass (mlx-vlm {info.mlx_vlm_version} ships none; "
            f"the first release that does is {FIRST_UPSTREAM_RELEASE})",
        )
    module = importlib.import_module(PACKAGE)
    package_dir = Path(module.__file__ or "").resolve().parent
    vendored_live = within(module.__file__, Path(info.vendor_dir))
    if vendored_live != (kind == VENDORED):
        raise CouldNotRun(f"could not make the {kind} cohere_compass live: {PACKAGE} is {module.__file__}")
    return Target(kind, True, package_dir, info.mlx_vlm_version)
