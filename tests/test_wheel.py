"""The built wheel carries the vendored tree, and the INSTALLED copy (not the source tree) patches mlx-vlm.

The wheel is built with pip (hatchling comes from PyPI as the build backend) and
installed with ``--no-deps`` into a fresh venv. That venv sees this pin env's
packages through a plain path line in a .pth file, so mlx / mlx-vlm are not
reinstalled, and the pin env's own .pth files (among them the editable install
pointing at this repo) are NOT processed: the source tree stays off sys.path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path
from typing import Any, Dict

import pytest

from tests.support.vendored import default_run_only, expected_live, upstream_ships

REPO = Path(__file__).resolve().parents[1]
FORCE_ENV = "COMPASS_COMPAT_FORCE_VENDORED"
IMPLEMENTATION_ENV = "COMPASS_COMPAT_IMPLEMENTATION"
# Whether this mlx-vlm ships its own models/cohere_compass (0.6.13 was the first release that did).
UPSTREAM_SHIPS = upstream_ships()
pytestmark = default_run_only  # each installed-wheel run sets its own switch


def run(cmd: list, **kwargs: Any) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def under(path: str, directory: Path) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([real, base]) == base


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", out, REPO])
    wheels = sorted(out.glob("compass_compat-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """A fresh venv holding only the wheel, seeing this pin env's packages."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "--quiet", wheel])
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (purelib / "_compass_compat_pin_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return {"python": python, "purelib": purelib}


def test_wheel_carries_the_vendored_tree(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    vendored_sources = {
        "compass_compat/_vendor/" + p.relative_to(REPO / "vendor").as_posix()
        for p in (REPO / "vendor").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert "compass_compat/_vendor/mlx_vlm/models/cohere_compass/__init__.py" in vendored_sources
    assert vendored_sources <= names
    assert {"compass_compat/__init__.py", "compass_compat/_patch.py", "compass_compat/errors.py"} <= names
    # mlx_vlm/ and mlx_vlm/models/ must stay plain directories: an __init__.py
    # there would make them packages that could shadow the installed mlx-vlm.
    assert "compass_compat/_vendor/mlx_vlm/__init__.py" not in names
    assert "compass_compat/_vendor/mlx_vlm/models/__init__.py" not in names
    assert not any(n.startswith("vendor/") or n.endswith(".pyc") for n in names)


def test_wheel_carries_every_package_file(wheel: Path):
    """Data and non-Python files too: the toy weights, the demo picture, the tiny tokenizer (what
    ``generate`` with no arguments needs); and no workshop: the checklist runs from a checkout."""
    names = set(zipfile.ZipFile(wheel).namelist())
    files = {
        p.relative_to(REPO).as_posix()
        for package in ("compass_compat", "compass_data")
        for p in (REPO / package).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }
    files.discard("compass_compat/compass_compat_autopatch.pth")  # installed at the top level
    assert {"compass_data/toy_shapes/model.safetensors", "compass_compat/assets/demo.png"} <= files
    assert files <= names, sorted(files - names)
    assert not any(n.startswith(("scripts/", "tests/")) or "/checklist/" in n for n in names)


# An absolute path: two or more components after a leading slash, or a Windows drive.
ABSOLUTE_PATH = re.compile(r"""(?:^|[\s"'=(`])((?:/[\w.@+-]+){2,}/?|[A-Za-z]:\\\w)""")


def test_wheel_data_files_name_no_path_of_the_building_machine(wheel: Path):
    """Records that ship (verdicts' commands, the toy's provenance) keep paths relative to the checkout."""
    found = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.endswith((".py", ".png", ".avi", ".safetensors")) or ".dist-info/" in name:
                continue
            text = archive.read(name).decode("utf-8")
            hits = [m.group(1) for m in ABSOLUTE_PATH.finditer(text)]
            if hits:
                found[name] = hits[:3]
    assert not found, found


def test_the_absolute_path_check_finds_one():
    assert [m.group(1) for m in ABSOLUTE_PATH.finditer('"--out /work/x/build" C:\\Users')] == ["/work/x/build", "C:\\U"]


def test_wheel_version_is_the_package_version(wheel: Path):
    """pyproject.toml reads the version from compass_compat/__init__.py (one place)."""
    import compass_compat

    assert wheel.name.startswith(f"compass_compat-{compass_compat.__version__}-"), wheel.name


@pytest.mark.parametrize("mode", ["auto", "vendored", "upstream"])
def test_installed_wheel_applies_the_patch(installed: Dict[str, Path], tmp_path: Path, mode: str):
    """The shipped record decides (auto), the switch overrides; from the wheel, not the checkout."""
    if mode == "upstream" and not UPSTREAM_SHIPS:
        pytest.skip("this mlx-vlm ships no cohere_compass (upstream is refused: tests/test_shim.py)")
    code = textwrap.dedent(
        """
        import json, sys
        import compass_compat
        from mlx_vlm.utils import get_model_and_args
        arch, _ = get_model_and_args({"model_type": "cohere_compass"})
        info = compass_compat.implementation_info()
        print(json.dumps({"shim": compass_compat.__file__, "arch": arch.__file__, "vendor": info.vendor_dir,
                          "impl": info.implementation, "sys_path": sys.path}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", FORCE_ENV, IMPLEMENTATION_ENV)}
    env[IMPLEMENTATION_ENV] = mode
    proc = run([installed["python"], "-c", code], cwd=tmp_path, env=env)  # cwd outside the repo
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    wheel_pkg = installed["purelib"] / "compass_compat"
    assert under(out["shim"], wheel_pkg)
    assert Path(out["vendor"]) == (wheel_pkg / "_vendor").resolve()
    assert not any(p and os.path.realpath(p) == str(REPO) for p in out["sys_path"])
    expected = expected_live(mode)
    assert out["impl"] == expected
    if expected == "vendored":
        assert under(out["arch"], wheel_pkg / "_vendor" / "mlx_vlm" / "models" / "cohere_compass")
    assert not under(out["arch"], REPO / "vendor")
