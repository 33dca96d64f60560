"""compass-compat: cohere_compass (Cohere North-Micro-Vision) for mlx-vlm releases that predate it.

``import compass_compat`` patches the installed mlx-vlm (see :func:`apply_patch`):
afterwards ``mlx_vlm.load`` / ``mlx_vlm.generate`` handle ``cohere_compass``
checkpoints. Where mlx-vlm ships its own ``cohere_compass`` (0.6.13 and later)
that one stays live unless ``COMPASS_COMPAT_FORCE_VENDORED=1`` is set (or
``apply_patch(force_vendored=True)`` is called); :func:`implementation_info`
says which one is live and why. Importing never imports torch.
"""

from ._patch import (
    FORCE_ENV,
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
    "CompassCompatError",
    "ImplementationInfo",
    "apply_patch",
    "implementation_info",
    "is_compass_checkpoint",
    "remove_patch",
    "vendor_root",
]

apply_patch()
