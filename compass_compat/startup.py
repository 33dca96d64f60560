"""Opt-in autopatch: patch mlx-vlm inside processes whose code you do not control.

Host servers such as ``mlx-openai-server`` or ``mlx-omni-server`` load models through
mlx-vlm and never import ``compass_compat``. The wheel therefore installs a one-line
``compass_compat_autopatch.pth`` and the small ``compass_compat_autopatch`` module next to
the packages (site-packages). Python runs that line at every interpreter start; it reads one
environment variable and stops there unless the user opted in::

    COMPASS_COMPAT_AUTOPATCH=1 mlx-openai-server launch --model-path ...   # or
    python -m compass_compat run -- mlx-openai-server launch --model-path ...

Only ``1``/``true``/``yes``/``on`` (any case) opt in. Then the line installs a
``sys.meta_path`` finder (``compass_compat_autopatch.install``) and imports nothing else:
mlx-vlm, transformers and ``compass_compat`` are imported when the host first imports
``mlx_vlm``, and the patch is applied right there, on the importing thread. Any other value,
or no value, costs one ``os.environ`` lookup: ``sys.modules`` is exactly what it would be
without the package.

A patch that cannot apply makes the host's ``import mlx_vlm`` raise its
``CompassCompatError`` (every time it is tried), instead of letting the host run unpatched.

This module holds the names and the installation checks the CLI uses (``run``, ``info``);
nothing imports it at startup, since importing any ``compass_compat`` module applies the
patch (``compass_compat/__init__.py``).
"""

from __future__ import annotations

import os
import site
import sysconfig
from pathlib import Path
from typing import List, Mapping, Optional

from compass_compat_autopatch import ENV, TRUE_VALUES

PTH_NAME = "compass_compat_autopatch.pth"
HOOK_MODULE = "compass_compat_autopatch"
# The shipped files: compass_compat/compass_compat_autopatch.pth and <repo>/compass_compat_autopatch.py,
# both placed at the wheel root (site-packages) by pyproject.toml's force-include (tests check it).
PTH_SOURCE = Path(__file__).resolve().parent / PTH_NAME
HOOK_SOURCE = Path(__file__).resolve().parent.parent / f"{HOOK_MODULE}.py"


def opted_in(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``COMPASS_COMPAT_AUTOPATCH`` asks for the patch (same test as the .pth line)."""
    environ = os.environ if environ is None else environ
    return environ.get(ENV, "").strip().lower() in TRUE_VALUES


def site_dirs() -> List[Path]:
    """Directories whose ``.pth`` files this interpreter processes at startup."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    dirs += list(getattr(site, "getsitepackages", lambda: [])())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    seen, out = set(), []
    for d in dirs:
        path = Path(d).resolve()
        if path not in seen:
            seen.add(path)
            out.append(path)
    return out


def installed_hooks() -> List[Path]:
    """The autopatch ``.pth`` files this interpreter will run at startup (normally one)."""
    return [d / PTH_NAME for d in site_dirs() if (d / PTH_NAME).is_file()]


__all__ = [
    "ENV",
    "HOOK_MODULE",
    "HOOK_SOURCE",
    "PTH_NAME",
    "PTH_SOURCE",
    "TRUE_VALUES",
    "installed_hooks",
    "opted_in",
    "site_dirs",
]
