"""Opt-in autopatch (``COMPASS_COMPAT_AUTOPATCH=1``): the names and installation checks the CLI's
``run`` and ``info`` use. How the shipped ``.pth`` hook works, and what it costs: docs/hosts.md.
Nothing imports this module at startup (importing ``compass_compat`` applies the patch)."""

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
