"""oMLX's engine (PyPI flyto-mlx 0.7.0) serving the default checkpoint (the toy), end to end.

Runs scripts/hosts/omlx/e2e.py (which starts `omlx serve` on 127.0.0.1 with the startup hook and
compares every answer with `python -m compass_compat generate`). Only in an environment that has
oMLX, i.e. .venvs/omlx-0.7.0 (scripts/hosts/omlx/env.sh; scripts/hosts/omlx/run.sh builds it and runs
this test); the pin matrix's environments skip it. Extra arguments for the script, e.g.
`--git-rev HEAD`, come from $OMLX_E2E_ARGS (split on whitespace).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "hosts" / "omlx" / "e2e.py"
OMLX_EXE = pathlib.Path(sys.executable).with_name("omlx")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("omlx") is None or not OMLX_EXE.exists(),
    reason="oMLX (flyto-mlx) is not installed in this environment; scripts/hosts/omlx/run.sh builds "
    ".venvs/omlx-0.7.0 and runs this test there",
)


def test_omlx_serve_matches_compass_compat_generate():
    out = ROOT / "build" / "omlx"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), *os.environ.get("OMLX_E2E_ARGS", "").split()]
    # The script bounds itself (--deadline 480 s by default); this is the backstop.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=660, cwd=str(ROOT))
    (out / "e2e.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    print(proc.stdout)
    table = proc.stdout[proc.stdout.find("request ") :] if "request " in proc.stdout else proc.stdout[-4000:]
    assert proc.returncode == 0, (
        f"omlx_e2e.py exited {proc.returncode} (log: {out / 'e2e.log'}, server: {out / 'serve.log'}):\n"
        f"{table}\n{proc.stderr[-2000:]}"
    )
