"""Opt-in autopatch (``COMPASS_COMPAT_AUTOPATCH=1``): the names and installation checks the CLI's
``run`` and ``info`` use. How the shipped ``.pth`` hook works, and what it costs: docs/hosts.md.
Nothing imports this module at startup (importing ``compass_compat`` applies the patch)."""

from __future__ import annotations

import site
import sysconfig
from pathlib import Path
from typing import List

from compass_compat_autopatch import ENV  # noqa: F401  (the CLI and the tests name it here)

PTH_NAME = "compass_compat_autopatch.pth"


def installed_hooks() -> List[Path]:
    """The autopatch ``.pth`` files this interpreter will run at startup (normally one)."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    unique = dict.fromkeys(Path(d).resolve() for d in dirs)  # each directory once, in order
    return [d / PTH_NAME for d in unique if (d / PTH_NAME).is_file()]
