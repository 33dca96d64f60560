"""The one exception compass-compat raises about patching mlx-vlm."""

from __future__ import annotations

from typing import Sequence


class CompassCompatError(RuntimeError):
    """compass-compat could not patch (or unpatch) the installed mlx-vlm.

    Attributes:
        hooks: the mlx-vlm / transformers attributes that were missing or wrong,
            as dotted names (empty when the failure is not about a hook).
        mlx_vlm_version: the installed mlx-vlm version, or ``"unknown"``.
    """

    def __init__(
        self,
        message: str,
        *,
        hooks: Sequence[str] = (),
        mlx_vlm_version: str = "unknown",
    ) -> None:
        super().__init__(message)
        self.hooks = tuple(hooks)
        self.mlx_vlm_version = mlx_vlm_version
