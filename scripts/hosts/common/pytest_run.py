"""What tests/test_host_e2e.py needs: is the host here, and run its e2e.py as a test."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# The module that tells the host is installed in this interpreter, per host.
HOST_MODULES = {
    "lmstudio": "mlx_engine.server",
    "omlx": "omlx",
    "omni": "mlx_omni_server",
    "rapid_mlx": "rapid_mlx",
    "vmlx": "vmlx_engine",
}


def host_installed(host: str) -> bool:
    """Whether this interpreter has the host (without importing it: find_spec of the top package)."""
    top = HOST_MODULES[host].split(".")[0]
    return importlib.util.find_spec(top) is not None


def run_host_e2e(host: str, timeout: float = 3600) -> None:
    """Run scripts/hosts/<host>/e2e.py here; fail with its table unless every request is equal."""
    out = ROOT / "build" / "hosts" / host
    out.mkdir(parents=True, exist_ok=True)
    script = ROOT / "scripts" / "hosts" / host / "e2e.py"
    cmd = [sys.executable, str(script), "--out", str(out), *os.environ.get("HOST_E2E_ARGS", "").split()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    (out / "e2e.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    print(proc.stdout)
    table = proc.stdout[proc.stdout.find("host ") :] if "host " in proc.stdout else proc.stdout[-4000:]
    assert proc.returncode == 0, (
        f"{script.name} exited {proc.returncode} (log {out / 'e2e.log'}):\n{table}\n{proc.stderr[-2000:]}"
    )
