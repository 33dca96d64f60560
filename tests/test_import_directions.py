"""scripts/check/imports.py (run by the lint step) keeps the import directions: scripts/ imports
of tests/ only tests.support, nothing shipped imports tests/ or scripts/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "scripts" / "check" / "imports.py"


def run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), str(root)], capture_output=True, text=True, timeout=120)


def test_this_tree_keeps_them():
    proc = run(REPO)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize(
    "where,line",
    [
        ("scripts/bench/planted.py", "from tests import conftest"),
        ("scripts/bench/planted.py", "import tests.test_parity"),
        ("compass_compat/planted.py", "import tests.support.contract"),
        ("compass_data/planted.py", "from scripts.bench import fullsize"),
        ("vendor/mlx_vlm/models/cohere_compass/planted.py", "from tests import conftest"),
    ],
)
def test_a_planted_import_fails_it_by_name(tmp_path, where, line):
    for folder in ("scripts", "compass_compat", "compass_data", "vendor"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / where).write_text(line + "\n")
    proc = run(tmp_path)
    assert proc.returncode == 1 and proc.stdout.startswith(f"{where}:1: imports"), proc.stdout


@pytest.mark.parametrize("line", ["from tests.support.server import Server", "from tests import support"])
def test_scripts_may_import_the_support_code(tmp_path, line):
    for folder in ("scripts", "compass_compat", "compass_data", "vendor"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "scripts/bench/planted.py").write_text(line + "\n")
    proc = run(tmp_path)
    assert proc.returncode == 0, proc.stdout
