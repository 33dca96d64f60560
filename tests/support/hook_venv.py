"""A throw-away interpreter with this tree's autopatch installed as the wheel installs it.

The pin environments install compass-compat editable, but the autopatch's two files are copies
placed in site-packages at install time, so they are whatever tree last installed them. This
builds a venv (no pip) that sees a pin environment's packages and this tree's code through
plain path lines, and holds this tree's ``compass_compat_autopatch.pth`` and
``compass_compat_autopatch.py`` at the top of its own site-packages, where pyproject.toml's
force-include puts them. None of the pin environment's own ``.pth`` files run in it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[2]
PTH_NAME = "compass_compat_autopatch.pth"
MODULE_FILE = "compass_compat_autopatch.py"
# Source (relative to the repo) -> name at the top of site-packages: pyproject.toml's force-include.
SHIPPED = {f"compass_compat/{PTH_NAME}": PTH_NAME, MODULE_FILE: MODULE_FILE}


def _purelib(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return Path(out.stdout.strip())


def _package_dirs(python: Path) -> List[str]:
    """Where ``python`` finds its packages: its sys.path past the standard library, including
    what its .pth files add (a venv can see another through a path line), but no directory that
    holds a ``compass_compat`` package (an editable install's source tree)."""
    code = (
        "import json, sys, sysconfig; std = sysconfig.get_paths()['stdlib']; "
        "print(json.dumps([p for p in sys.path[1:] if p and not p.startswith(std)]))"  # stdlib, lib-dynload
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True, timeout=120, env=env, cwd="/"
    )
    dirs = [Path(p) for p in json.loads(out.stdout)]
    return [str(d) for d in dirs if d.is_dir() and not (d / "compass_compat" / "__init__.py").is_file()]


def build(pin_python: Path, where: Path, repo: Path = REPO, hook: bool = True) -> Path:
    """Make the venv at ``where`` from ``pin_python``'s base interpreter; return its python.

    ``hook=False`` leaves the autopatch files out (an interpreter that never saw the package).
    """
    subprocess.run([str(pin_python), "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    purelib = _purelib(python)
    # The tree first, so its compass_compat wins over anything the pin environment holds.
    lines = ([str(repo)] if hook else []) + _package_dirs(pin_python)
    (purelib / "_compass_compat_paths.pth").write_text("\n".join(lines) + "\n")
    if hook:
        for source, name in SHIPPED.items():
            shutil.copyfile(repo / source, purelib / name)
    return python
