"""Processes we do not control: plain ``python -m mlx_vlm.generate``, with and without opting in.

The installed package ships ``compass_compat_autopatch.pth`` and the ``compass_compat_autopatch``
module (site-packages). Opted in (``COMPASS_COMPAT_AUTOPATCH=1``, or ``python -m compass_compat
run -- ...``) the host process is patched when it imports mlx-vlm and generates; not opted in it
behaves exactly as an interpreter that never saw the package: same output, same failure, no
``compass_compat`` in ``sys.modules``, no ``cohere_compass`` added to ``MODEL_CONFIG``, and
nothing imported at startup. tests/test_autopatch.py covers the hook itself.

The host processes run in a venv with this tree's hook installed as the wheel installs it
(``tests/support/hook_venv.py``: the pin env's installed copies may be an older tree's); the
first two tests check the pin env's own installation. "Without the package" is a real
interpreter: a venv that sees this pin env's site-packages through a plain path line, so none
of the pin env's ``.pth`` files (our hook, the editable install) run in it. The heavy
subprocesses start together in one fixture (each imports mlx-vlm, which takes seconds) and are
awaited once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import pytest

import compass_compat
from compass_compat import startup
from tests.support import hook_venv
from tests.support.cli_run import greedy_cli_output
from tests.support.vendored import upstream_ships

# Whether this mlx-vlm ships its own models/cohere_compass (0.6.13 was the first release that did).
UPSTREAM_SHIPS = upstream_ships()
PROMPT = "Describe the image."
MAX_TOKENS = 8
HEAVY = ("compass_compat", "mlx", "mlx_vlm", "transformers", "numpy", "PIL")
TIMING = re.compile(r"tokens-per-sec|Peak memory|RuntimeWarning: 'mlx_vlm\.generate' found in sys\.modules")


def host_env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (startup.ENV, "PYTHONPATH")}
    env.update(extra)
    return env


def generate_argv(model: Path, image: Path) -> List[str]:
    # Flags every pin's mlx_vlm.generate accepts (0.4.4 to 0.7.10).
    return [
        "-m",
        "mlx_vlm.generate",
        "--model",
        str(model),
        "--image",
        str(image),
        "--prompt",
        PROMPT,
        "--max-tokens",
        str(MAX_TOKENS),
        "--temperature",
        "0",
    ]


STATE_PROBE = textwrap.dedent(
    """
    import json, sys
    import mlx_vlm.utils
    from mlx_vlm.prompt_utils import MODEL_CONFIG
    try:
        mlx_vlm.utils.load(sys.argv[1])
        error = None
    except Exception as exc:  # reported: the test compares it with mlx-vlm's own message
        error = f"{type(exc).__name__}: {exc}"
    shim = sys.modules.get("compass_compat")  # never imported here: only the autopatch hook can
    print(json.dumps({"compass_compat": shim is not None,
                      "cohere_compass_in_MODEL_CONFIG": "cohere_compass" in MODEL_CONFIG, "load_error": error,
                      "implementation": shim.implementation_info().implementation if shim else None}))
    """
)


@pytest.fixture(scope="module")
def baseline_python(tmp_path_factory) -> Path:
    """An interpreter with this env's packages but none of its .pth hooks (no compass-compat)."""
    return hook_venv.build(Path(sys.executable), tmp_path_factory.mktemp("baseline") / "env", hook=False)


@pytest.fixture(scope="module")
def hooked_python(tmp_path_factory) -> Path:
    """An interpreter with this env's packages and this tree's code and hook, installed as the wheel does."""
    return hook_venv.build(Path(sys.executable), tmp_path_factory.mktemp("hooked") / "env")


@pytest.fixture(scope="module")
def runs(
    baseline_python, hooked_python, tiny_ckpt_original, fixture_images, tmp_path_factory
) -> Dict[str, subprocess.CompletedProcess]:
    """Every heavy subprocess of this module, started together, awaited together."""
    image = fixture_images["synth_320x256.png"]
    cwd = tmp_path_factory.mktemp("hosts")  # outside the repo: `python -m` puts the cwd on sys.path
    gen = generate_argv(tiny_ckpt_original, image)
    host = str(hooked_python)
    plan = {
        "not opted in": ([host, *gen], host_env()),
        "without the package": ([str(baseline_python), *gen], host_env()),
        "state, not opted in": ([host, "-c", STATE_PROBE, str(tiny_ckpt_original)], host_env()),
        "opted in": ([host, *gen], host_env(**{startup.ENV: "1"})),
        "state, opted in (TRUE)": (
            [host, "-c", STATE_PROBE, str(tiny_ckpt_original)],
            host_env(**{startup.ENV: "TRUE"}),
        ),
        "run --": ([host, "-m", "compass_compat", "run", "--", host, *gen], host_env()),
        # The README's un-activated form: `python` names another interpreter on PATH (one without
        # mlx-vlm); `run` must start this environment's own (it once ran PATH's: No module named 'mlx_vlm').
        "run -- python, not activated": (
            [host, "-m", "compass_compat", "run", "--", "python", *gen],
            host_env(PATH=os.pathsep.join(("/usr/bin", "/bin"))),
        ),
    }
    procs = {
        name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(cwd))
        for name, (cmd, env) in plan.items()
    }
    done = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"{name}: no result within 600 s")
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


@pytest.fixture(scope="module")
def cli_text(tiny_ckpt_original, fixture_images) -> str:
    """The greedy text ``python -m compass_compat generate`` prints for the same inputs."""
    return greedy_cli_output(tiny_ckpt_original, PROMPT, MAX_TOKENS, fixture_images["synth_320x256.png"]).strip()


def comparable(text: str) -> List[str]:
    return [line for line in text.splitlines() if not TIMING.search(line)]


def describe(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


# ------------------------------------------------------------------ the hook itself


def test_the_startup_hook_is_installed_and_is_the_shipped_file():
    hooks = startup.installed_hooks()
    reinstall = "reinstall the package (pip install --no-deps -e .) so the hook in this env is this tree's"
    assert hooks, f"{startup.PTH_NAME} is not in this env's site-packages; {reinstall}"
    for hook in hooks:
        for source, name in hook_venv.SHIPPED.items():  # the .pth and the hook module beside it
            shipped, installed = hook_venv.REPO / source, hook.parent / name
            assert installed.is_file(), f"{installed} is missing; {reinstall}"
            assert installed.read_text() == shipped.read_text(), f"{installed} is an older copy; {reinstall}"


def test_the_wheel_puts_the_hook_into_site_packages():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    repo = Path(__file__).resolve().parents[1]
    build = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    force_include = build["targets"]["wheel"]["force-include"]
    pth, hook = startup.PTH_NAME, "compass_compat_autopatch.py"
    shipped = {f"compass_compat/{pth}": pth, hook: hook}  # source in the repo -> name in site-packages
    assert {source: force_include.get(source) for source in shipped} == shipped
    # The hook venv these tests run hosts in lays the files out the same way.
    assert hook_venv.SHIPPED == shipped


def test_not_opted_in_costs_no_import(hooked_python, tmp_path):
    """At startup without the opt-in nothing of ours (nor mlx) is imported, whatever the value."""
    probe = "import json, sys; print(json.dumps(sorted(sys.modules)))"
    seen = {}
    for value in (None, "", "0", "off", "false", "no", "maybe"):
        env = host_env() if value is None else host_env(**{startup.ENV: value})
        out = subprocess.run(
            [str(hooked_python), "-c", probe],
            capture_output=True,
            text=True,
            env=env,
            cwd=str(tmp_path),
            check=True,
            timeout=60,
        )
        seen[value] = set(json.loads(out.stdout))
        assert not {m for m in seen[value] if m.split(".")[0] in HEAVY}, value
        assert not out.stderr, out.stderr
    assert all(mods == seen[None] for mods in seen.values())


# ------------------------------------------------------------------ not opted in


def test_not_opted_in_generate_behaves_exactly_as_without_the_package(runs):
    baseline = runs["without the package"]
    host = runs["not opted in"]  # other non-opt-in values import nothing at all (test above)
    assert host.returncode == baseline.returncode, f"host:\n{describe(host)}\nbaseline:\n{describe(baseline)}"
    assert comparable(host.stdout) == comparable(baseline.stdout)
    assert comparable(host.stderr) == comparable(baseline.stderr)
    if not UPSTREAM_SHIPS:
        # mlx-vlm's own failure for a model type it does not know.
        assert baseline.returncode != 0
        assert "Model type cohere_compass not supported" in baseline.stderr.strip().splitlines()[-1]
    else:
        assert baseline.returncode == 0, describe(baseline)  # upstream's own cohere_compass serves it


def test_not_opted_in_leaves_modules_and_model_config_alone(runs):
    state = json.loads(runs["state, not opted in"].stdout.strip().splitlines()[-1])
    assert state["compass_compat"] is False
    assert state["cohere_compass_in_MODEL_CONFIG"] is UPSTREAM_SHIPS  # only upstream's own entry, if any
    if UPSTREAM_SHIPS:
        assert state["load_error"] is None
    else:
        assert "Model type cohere_compass not supported" in state["load_error"]


# ---------------------------------------------------------------------- opted in


def test_opted_in_patches_when_mlx_vlm_is_imported(runs):
    proc = runs["state, opted in (TRUE)"]
    assert proc.returncode == 0, describe(proc)
    state = json.loads(proc.stdout.strip().splitlines()[-1])
    assert state["compass_compat"] and state["cohere_compass_in_MODEL_CONFIG"] and state["load_error"] is None
    # The hook honours COMPASS_COMPAT_IMPLEMENTATION as `import compass_compat` does here.
    assert state["implementation"] == compass_compat.implementation_info().implementation


@pytest.mark.parametrize("how", ["opted in", "run --", "run -- python, not activated"])
def test_opted_in_plain_mlx_vlm_generate_generates(runs, cli_text, how):
    proc = runs[how]
    assert proc.returncode == 0, describe(proc)
    assert cli_text and cli_text in proc.stdout, f"expected {cli_text!r} in:\n{proc.stdout}"
    assert "Traceback" not in proc.stderr, proc.stderr
