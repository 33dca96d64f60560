"""The opt-in autopatch imports nothing at startup and patches mlx-vlm when the host imports it.

Every case is a fresh interpreter built by ``tests/support/hook_venv.py``: it sees this pin
env's packages and this tree's code, with this tree's ``.pth`` and hook module at the top of
its site-packages as the wheel puts them (the pin env's own installed copies may be an older
tree's). The probes that import mlx-vlm start together and are awaited once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

import compass_compat
from compass_compat import startup
from tests.support import hook_venv
from tests.support.cli_run import greedy_cli_output
from tests.support.vendored import upstream_ships

UPSTREAM_SHIPS = upstream_ships()
HEAVY = ("compass_compat", "mlx", "mlx_vlm", "transformers", "numpy", "PIL", "torch")
HOOK = "compass_compat_autopatch"
IMAGE = Path(__file__).resolve().parent / "fixtures" / "images" / "synth_320x256.png"
# Which implementation `import compass_compat` makes live here (COMPASS_COMPAT_IMPLEMENTATION
# as set for this run); the hook must end in the same state.
EXPECTED = compass_compat.implementation_info().implementation

PROBE = textwrap.dedent(
    """
    import json, sys, threading
    mode, ckpt = sys.argv[1], sys.argv[2]
    # (file, thread) of every module body executed from here on: the "exec" audit event fires on
    # the thread that runs the code ("import" fires on every thread that finds it not yet loaded).
    events = []
    sys.addaudithook(
        lambda e, a: events.append((getattr(a[0], "co_filename", ""), threading.get_ident())) if e == "exec" else None
    )
    out = {"main": threading.get_ident()}

    def state():
        prompt_utils = sys.modules.get("mlx_vlm.prompt_utils")
        shim = sys.modules.get("compass_compat")
        return {
            "mlx_vlm": "mlx_vlm" in sys.modules,
            "cohere_compass_in_MODEL_CONFIG": bool(prompt_utils) and "cohere_compass" in prompt_utils.MODEL_CONFIG,
            "compass_compat": shim is not None,
            "hook_imported": "compass_compat_autopatch" in sys.modules,
            "finders": [type(f).__name__ for f in sys.meta_path if getattr(f, "__compass_compat__", False)],
        }

    def executed(tail):
        return sorted({t for f, t in events if f.endswith(tail)})

    if mode == "startup":
        out["modules"] = sorted(sys.modules)
    elif mode in ("mlx_vlm", "mlx_vlm.utils", "transformers first", "compass_compat"):
        if mode == "transformers first":
            from transformers import AutoProcessor
        __import__(mode if mode != "transformers first" else "mlx_vlm")
        out["after_import"] = state()
        import mlx_vlm
        out["loader"] = type(mlx_vlm.__loader__).__name__
        out["spec_loader"] = type(mlx_vlm.__spec__.loader).__name__
        shim = sys.modules.get("compass_compat")
        vendored = shim is not None and shim.implementation_info().implementation == "vendored"
        if mode == "transformers first" and vendored:  # upstream's: transformers' own, which needs torchvision
            out["processor_file"] = sys.modules[type(AutoProcessor.from_pretrained(ckpt)).__module__].__file__
        import mlx_vlm.utils
        try:
            mlx_vlm.utils.load(ckpt)
            out["load_error"] = None
        except Exception as exc:  # reported: mlx-vlm's own failure for a model type it does not know
            out["load_error"] = f"{type(exc).__name__}: {exc}"
        if out["after_import"]["compass_compat"]:
            out["implementation"] = sys.modules["compass_compat"].implementation_info().implementation
    elif mode in ("thread", "two threads"):
        count = 1 if mode == "thread" else 2
        barrier = threading.Barrier(count)
        seen = {}

        def work():
            barrier.wait()
            import mlx_vlm
            from mlx_vlm.prompt_utils import MODEL_CONFIG
            seen[threading.get_ident()] = "cohere_compass" in MODEL_CONFIG  # at the moment import returned

        threads = [threading.Thread(target=work) for _ in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["workers"] = [t.ident for t in threads]
        out["patched_when_import_returned"] = [seen[t.ident] for t in threads]
        out["loaded_mlx_vlm_on"] = executed("/mlx_vlm/__init__.py")
        out["loaded_compass_compat_on"] = executed("/compass_compat/__init__.py")
        out["loaded_patch_on"] = executed("/compass_compat/_patch.py")
        out["after_import"] = state()
        out["implementation"] = sys.modules["compass_compat"].implementation_info().implementation
    elif mode == "failing":
        out["attempts"] = []
        for _ in range(2):
            try:
                import mlx_vlm
                out["attempts"].append(None)
            except BaseException as exc:
                out["attempts"].append({"type": type(exc).__name__, "module": type(exc).__module__,
                                        "message": str(exc), "notes": getattr(exc, "__notes__", [])})
        out["after_import"] = state()
        models = sys.modules.get("mlx_vlm.models")
        out["models_path"] = list(models.__path__) if models else None
    elif mode == "generate on a worker":
        # A host that imports mlx-vlm lazily on its worker (vMLX) and generates there.
        def generate():
            import mlx_vlm.generate
            out["after_import"] = state()
            sys.argv = ["mlx_vlm.generate", "--model", ckpt, "--image", sys.argv[4], "--prompt", "Describe the image.",
                        "--max-tokens", "8", "--temperature", "0"]
            sys.modules["mlx_vlm.generate"].main()  # the package's attribute is the function

        worker = threading.Thread(target=generate)
        worker.start()
        worker.join()
        out["loaded_patch_on"] = executed("/compass_compat/_patch.py")
        out["worker"] = worker.ident
    elif mode.startswith("lm:"):  # import one package, then load the checkpoint with mlx-lm
        try:
            __import__(mode[3:])
            out["after_import"] = state()
            import mlx_lm
            model, _ = mlx_lm.load(ckpt)
            out["model_file"] = sys.modules[type(model).__module__].__file__
            out["error"] = None
        except BaseException as exc:
            out.setdefault("after_import", state())
            out["error"] = {"type": type(exc).__name__, "module": type(exc).__module__, "message": str(exc),
                            "notes": getattr(exc, "__notes__", [])}
        out["lm_after"] = state()
    elif mode == "order":  # when apply_patch first runs, relative to mlx_vlm's package module
        order = []

        def profile(frame, event, arg):
            code = frame.f_code
            if event == "return" and code.co_name == "<module>" and code.co_filename.endswith("/mlx_vlm/__init__.py"):
                order.append("mlx_vlm/__init__.py done")
            elif event == "call" and code.co_name == "apply_patch" and code.co_filename.endswith("/_patch.py"):
                order.append("apply_patch")
            elif event == "return" and code.co_name == "<module>" and code.co_filename.endswith("/mlx_lm/__init__.py"):
                order.append("mlx_lm/__init__.py done")

        sys.setprofile(profile)
        try:
            import mlx_vlm
        except BaseException as exc:  # upstream live and the mlx-lm registration asked for: refused
            out["error"] = type(exc).__name__
        sys.setprofile(None)
        out["order"] = order
    elif mode == "install twice":
        import compass_compat_autopatch as hook
        hook.install()
        hook.install()
        exec(open(sys.argv[3]).read().splitlines()[-1])  # the .pth line again (a second site dir)
        out["after_import"] = state()
    print(json.dumps(out), flush=True)
    if mode in ("thread", "two threads", "generate on a worker"):
        # mlx-vlm imported on a non-main thread aborts at interpreter exit on 0.6.12 and 0.7.10 with
        # or without compass-compat ("terminate called without an active exception"): skip teardown.
        import os
        os._exit(0)
    """
)


def env_for(value: "str | None", **extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (startup.ENV, "PYTHONPATH")}
    if value is not None:
        env[startup.ENV] = value
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def hooked_python(tmp_path_factory) -> Path:
    return hook_venv.build(Path(sys.executable), tmp_path_factory.mktemp("hooked") / "env")


@pytest.fixture(scope="module")
def probe_cwd(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("probe")  # outside the repo: -c puts the cwd on sys.path


def probe_argv(python: Path, mode: str, ckpt: Path) -> List[str]:
    return [
        str(python),
        "-c",
        PROBE,
        mode,
        str(ckpt),
        (hook_venv.REPO / "compass_compat" / startup.PTH_NAME).as_posix(),
        str(IMAGE),
    ]


def probe(python: Path, cwd: Path, mode: str, ckpt: Path, env: Dict[str, str]) -> dict:
    proc = subprocess.run(
        probe_argv(python, mode, ckpt),
        capture_output=True,
        text=True,
        env=env,
        cwd=str(cwd),
        timeout=600,
    )
    assert proc.returncode == 0, f"{mode}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probes(hooked_python, probe_cwd, tiny_ckpt_original) -> Dict[str, dict]:
    """Every mlx-vlm-importing probe, started together, awaited together."""
    plan: Dict[str, Tuple[str, Dict[str, str]]] = {
        "mlx_vlm": ("mlx_vlm", env_for("1")),
        "mlx_vlm.utils": ("mlx_vlm.utils", env_for("1")),
        "transformers first": ("transformers first", env_for("1")),
        "compass_compat": ("compass_compat", env_for("1")),
        "thread": ("thread", env_for("1")),
        "two threads": ("two threads", env_for("1")),
        "failing": ("failing", env_for("1", COMPASS_COMPAT_FORCE_VENDORED="maybe")),
        "not opted in": ("mlx_vlm", env_for(None)),
        "generate on a worker": ("generate on a worker", env_for("1")),
        "mlx_lm, registration opted in": ("lm:mlx_lm", env_for("1", COMPASS_COMPAT_MLX_LM="1")),
        "mlx_vlm, registration opted in": ("lm:mlx_vlm", env_for("1", COMPASS_COMPAT_MLX_LM="1")),
        "mlx_lm alone": ("lm:mlx_lm", env_for("1")),
        "order": ("order", env_for("1", COMPASS_COMPAT_MLX_LM="1")),
    }
    procs = {
        name: subprocess.Popen(
            probe_argv(hooked_python, mode, tiny_ckpt_original),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(probe_cwd),
        )
        for name, (mode, env) in plan.items()
    }
    done = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:  # a deadlocked import lands here
            for p in procs.values():
                p.kill()
            pytest.fail(f"{name}: no result within 300 s (deadlocked import?)")
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{out}\n{err[-4000:]}"
        done[name] = json.loads(out.strip().splitlines()[-1])
        done[name]["stdout"] = out
    return done


def heavy(modules) -> set:
    return {m for m in modules if m.split(".")[0] in HEAVY}


# ---------------------------------------------------------------------- at startup


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " yes ", "On"])
def test_opted_in_startup_imports_only_the_hook(hooked_python, probe_cwd, tiny_ckpt_original, value):
    base = probe(hooked_python, probe_cwd, "startup", tiny_ckpt_original, env_for(None))
    opted = probe(hooked_python, probe_cwd, "startup", tiny_ckpt_original, env_for(value))
    assert not heavy(opted["modules"]), heavy(opted["modules"])
    # One module more than an interpreter that is not opted in: the hook itself.
    assert set(opted["modules"]) - set(base["modules"]) == {HOOK}
    assert set(base["modules"]) <= set(opted["modules"])


def test_opted_in_startup_installs_one_waiting_finder(hooked_python, probe_cwd, tiny_ckpt_original):
    code = (
        "import sys, json; print(json.dumps([type(f).__name__ for f in sys.meta_path "
        "if getattr(f, '__compass_compat__', False)]))"
    )
    for value, expected in (("1", ["AutopatchFinder"]), (None, []), ("0", [])):
        proc = subprocess.run(
            [str(hooked_python), "-c", code],
            capture_output=True,
            text=True,
            env=env_for(value),
            cwd=str(probe_cwd),
            check=True,
            timeout=60,
        )
        assert json.loads(proc.stdout) == expected, value
        assert not proc.stderr, proc.stderr


def test_install_is_idempotent(hooked_python, probe_cwd, tiny_ckpt_original):
    out = probe(hooked_python, probe_cwd, "install twice", tiny_ckpt_original, env_for("1"))
    assert out["after_import"]["finders"] == ["AutopatchFinder"]
    assert not out["after_import"]["mlx_vlm"] and not out["after_import"]["compass_compat"]


# ---------------------------------------------------------------- at `import mlx_vlm`


@pytest.mark.parametrize("mode", ["mlx_vlm", "mlx_vlm.utils", "transformers first", "compass_compat"])
def test_importing_mlx_vlm_applies_the_patch(probes, mode):
    out = probes[mode]
    state = out["after_import"]
    assert state["mlx_vlm"] and state["compass_compat"]
    assert state["cohere_compass_in_MODEL_CONFIG"]
    assert out["implementation"] == EXPECTED
    assert out["load_error"] is None
    # Done: the finder removed itself; after the host's own `import compass_compat` it is left
    # in place, inert (mlx_vlm is imported, so it is never asked again).
    assert state["finders"] == ([] if mode != "compass_compat" else ["AutopatchFinder"])
    # mlx_vlm keeps its own loader: the hook's wrapper leaves no trace on the module.
    assert out["loader"] == out["spec_loader"] == "SourceFileLoader"


def test_transformers_imported_first_still_gets_the_vendored_processor(probes):
    """The processor hook wraps AutoProcessor.from_pretrained on the class, so a host that took
    AutoProcessor from transformers before mlx-vlm was imported gets the vendored processor."""
    if EXPECTED != "vendored":
        pytest.skip("upstream's cohere_compass is live: the processor hook is not installed (runs forced)")
    processor_file = probes["transformers first"]["processor_file"]
    assert processor_file.startswith(str(compass_compat.vendor_root() / "mlx_vlm" / "models" / "cohere_compass"))


def test_the_patch_runs_on_the_thread_that_imports_mlx_vlm(probes):
    out = probes["thread"]
    (worker,) = out["workers"]
    assert worker != out["main"]
    assert out["loaded_mlx_vlm_on"] == [worker]
    assert out["loaded_compass_compat_on"] == [worker]
    assert out["loaded_patch_on"] == [worker]
    assert out["patched_when_import_returned"] == [True]
    assert out["implementation"] == EXPECTED


def test_two_threads_importing_at_once_both_get_it_patched(probes):
    out = probes["two threads"]
    # One thread loads mlx-vlm and patches it; the other waits on the import lock meanwhile.
    assert len(out["loaded_mlx_vlm_on"]) == 1
    assert out["loaded_compass_compat_on"] == out["loaded_mlx_vlm_on"]
    assert set(out["loaded_mlx_vlm_on"]) <= set(out["workers"])
    assert out["patched_when_import_returned"] == [True, True]
    assert out["after_import"]["finders"] == []


def test_a_patch_that_cannot_apply_fails_the_import_of_mlx_vlm_every_time(probes):
    out = probes["failing"]
    assert len(out["attempts"]) == 2
    for attempt in out["attempts"]:
        assert attempt is not None, "mlx_vlm imported unpatched"
        assert (attempt["module"], attempt["type"]) == ("compass_compat.errors", "CompassCompatError")
        assert "COMPASS_COMPAT_FORCE_VENDORED='maybe'" in attempt["message"]
        if sys.version_info >= (3, 11):
            assert any(startup.ENV in note for note in attempt["notes"]), attempt["notes"]
    state = out["after_import"]
    assert not state["mlx_vlm"] and not state["compass_compat"]
    assert state["finders"] == ["AutopatchFinder"]  # still waiting: the next import fails the same way
    # All or nothing: mlx-vlm's own table and path as without the package.
    assert state["cohere_compass_in_MODEL_CONFIG"] is UPSTREAM_SHIPS
    assert not any(p.startswith(str(compass_compat.vendor_root())) for p in out["models_path"]), out["models_path"]


def test_not_opted_in_importing_mlx_vlm_loads_nothing_of_ours(probes):
    state = probes["not opted in"]["after_import"]
    assert state["mlx_vlm"]
    assert not state["compass_compat"] and not state["hook_imported"] and state["finders"] == []
    assert state["cohere_compass_in_MODEL_CONFIG"] is UPSTREAM_SHIPS
    if not UPSTREAM_SHIPS:
        assert "Model type cohere_compass not supported" in probes["not opted in"]["load_error"]


def test_a_host_that_imports_mlx_vlm_on_its_worker_generates_there(probes, tiny_ckpt_original):
    """As vMLX does: the worker imports mlx-vlm (the patch runs there) and generates the CLI's text."""
    out = probes["generate on a worker"]
    assert out["loaded_patch_on"] == [out["worker"]]
    assert out["after_import"]["cohere_compass_in_MODEL_CONFIG"]
    expected = greedy_cli_output(tiny_ckpt_original, "Describe the image.", 8, IMAGE).strip()
    assert expected and expected in out["stdout"], f"expected {expected!r} in:\n{out['stdout']}"


@pytest.mark.parametrize("first", ["mlx_lm", "mlx_vlm"])
def test_with_the_mlx_lm_registration_importing_mlx_lm_applies_it(probes, first):
    """COMPASS_COMPAT_MLX_LM=1: a host that loads through mlx-lm never imports mlx-vlm, so mlx_lm
    triggers the patch too; mlx-vlm importing mlx-lm inside its own import patches once, after it."""
    out = probes[f"{first}, registration opted in"]
    if EXPECTED == "vendored":
        assert out["error"] is None, out["error"]
        assert out["after_import"]["compass_compat"] and out["after_import"]["finders"] == []
        assert out["model_file"].startswith(str(compass_compat.vendor_root() / "mlx_lm" / "models"))
    else:  # upstream's cohere_compass is live: the mlx-lm registration is refused, loudly, at the import
        assert (out["error"]["module"], out["error"]["type"]) == ("compass_compat.errors", "CompassCompatError")
        assert "COMPASS_COMPAT_IMPLEMENTATION=vendored" in out["error"]["message"]
        assert out["lm_after"]["finders"] == ["AutopatchFinder"]


def test_without_the_mlx_lm_registration_importing_mlx_lm_patches_nothing(probes):
    """A host that imports mlx-lm at startup and mlx-vlm later, on its worker, is patched there."""
    out = probes["mlx_lm alone"]
    state = out["after_import"]
    assert not state["compass_compat"] and not state["mlx_vlm"]
    assert state["finders"] == ["AutopatchFinder"]  # still waiting for mlx_vlm
    assert out["error"] is not None and "cohere_compass not supported" in out["error"]["message"]


def test_the_patch_starts_after_mlx_vlm_has_finished_executing(probes):
    """Even where mlx-vlm imports mlx-lm inside its own import (0.4.4 to 0.6.3) and mlx-lm is a
    target too (COMPASS_COMPAT_MLX_LM=1): the patch never sees a half-initialized mlx_vlm."""
    order = probes["order"]["order"]
    assert order.count("mlx_vlm/__init__.py done") == 1, order
    assert "apply_patch" in order, order
    assert order.index("mlx_vlm/__init__.py done") < order.index("apply_patch"), order
