"""Opt-in startup hook: patch mlx-vlm inside processes whose code you do not control.

Host servers such as ``mlx-openai-server`` or ``mlx-omni-server`` load models through
mlx-vlm and never import ``compass_compat``. The wheel therefore installs a one-line
``compass_compat_autopatch.pth`` next to the packages (site-packages). Python runs that
line at every interpreter start; it reads one environment variable and stops there unless
the user opted in::

    COMPASS_COMPAT_AUTOPATCH=1 mlx-openai-server launch --model-path ...   # or
    python -m compass_compat run -- mlx-openai-server launch --model-path ...

Only ``1``/``true``/``yes``/``on`` (any case) opt in. Then the line imports this module,
which imports ``compass_compat`` and so applies the patch before the host's own code runs
(mlx-vlm and transformers are imported at that moment). Any other value, or no value, costs
one ``os.environ`` lookup: ``compass_compat``, mlx and mlx-vlm are not imported and
``sys.modules`` is exactly what it would be without the package.

A patch that cannot apply raises ``CompassCompatError`` from the ``.pth`` line; Python's
``site`` module prints that traceback (naming the missing hook) and the host continues
unpatched, so it then fails the way mlx-vlm fails for an unknown model type.

The opt-in check lives in the ``.pth`` line itself, not here: importing any
``compass_compat`` module applies the patch (``compass_compat/__init__.py``).
"""

from __future__ import annotations

import os
import site
import sysconfig
from pathlib import Path
from typing import List

from . import apply_patch

ENV = "COMPASS_COMPAT_AUTOPATCH"
TRUE_VALUES = ("1", "true", "yes", "on")
PTH_NAME = "compass_compat_autopatch.pth"
# The shipped file: compass_compat/compass_compat_autopatch.pth, placed at the wheel root
# (site-packages) by pyproject.toml's force-include. Keep the two in sync (tests check it).
PTH_SOURCE = Path(__file__).resolve().parent / PTH_NAME


def opted_in(environ=None) -> bool:
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


# The .pth line imports this module only after its opt-in check passed, and importing the
# parent package already applied the patch: this call then returns False. It states the
# module's purpose and keeps it true should the package's import-time behaviour change.
apply_patch()

__all__ = ["ENV", "PTH_NAME", "PTH_SOURCE", "TRUE_VALUES", "installed_hooks", "opted_in", "site_dirs"]
