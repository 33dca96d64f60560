"""Items 5 and 6: what a fresh interpreter sees (``probes/``), without the shim in upstream mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Sequence

from ..harness import Context
from ..report import FAIL, PASS, VENDORED, Item, ItemResult
from ..target import within
from .base import needs_package, result

PROBES = Path(__file__).resolve().parent.parent / "probes"
SUBPROCESS_TIMEOUT = 600


def _run_probe(script: str, args: Sequence[str] = (), vendored: bool = False, force: bool = False) -> Dict[str, Any]:
    """Run ``probes/<script>`` in a fresh interpreter (cwd /, so the repo is not on sys.path) and
    parse its JSON; ``vendored`` has the probe apply the shim, ``force`` sets the switch to vendored too."""
    # No COMPASS_COMPAT_* switch leaks in (e.g. COMPASS_COMPAT_AUTOPATCH=1 would import the
    # shim at interpreter start and spoil the pristine upstream probes).
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPASS_COMPAT_")}
    if force:
        env["COMPASS_COMPAT_IMPLEMENTATION"] = "vendored"
    if vendored:  # this checkout's compass_compat, whichever one the environment installed
        env["PYTHONPATH"] = str(PROBES.parents[2])
    proc = subprocess.run(
        [sys.executable, str(PROBES / script), *(["--vendored"] if vendored else []), *args],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        cwd="/",
        env=env,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("CHECKLIST-JSON "):
            return json.loads(line[len("CHECKLIST-JSON ") :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"probe exited {proc.returncode}: " + " | ".join(tail)}


def check_model_config(ctx: Context, item: Item) -> ItemResult:
    """Item 5: the pristine MODEL_CONFIG (upstream: an interpreter that never imports compass_compat)."""
    vendored = ctx.target.kind == VENDORED
    out = _run_probe("probe_model_config.py", vendored=vendored)
    if "error" in out:
        return result(ctx, item, FAIL, out["error"], out)
    source = "after import compass_compat (forced)" if vendored else "pristine, compass_compat not imported"
    if out["compass_compat_imported"] and not vendored:
        return result(ctx, item, FAIL, "the probe imported compass_compat; not pristine", out)
    if out["registered"]:
        return result(ctx, item, PASS, f"MODEL_CONFIG['cohere_compass'] = {out['format']} ({source})", out)
    return result(
        ctx, item, FAIL, f"MODEL_CONFIG has no 'cohere_compass' among its {out['entries']} entries ({source})", out
    )


@needs_package
def check_processor_without_torch(ctx: Context, item: Item) -> ItemResult:
    """Item 6: with torch hidden, mlx_vlm.load and AutoProcessor build the implementation's processor."""
    vendored = ctx.target.kind == VENDORED
    name = ctx.reference.names("image")[0]
    out = _run_probe(
        "probe_processor.py",
        [str(ctx.checkpoint("original")), ctx.reference.image_paths(name)[0], ctx.reference.cases[name]["prompt"]],
        vendored=vendored,
        force=vendored,
    )
    problems = []
    if "error" in out:
        problems.append(out["error"])
    package_dir = ctx.target.package_dir
    for key in ("load_processor", "auto_processor"):
        if key in out and not within(out.get(key + "_file"), package_dir):
            problems.append(
                f"{key.replace('_', ' ')} built {out[key]} ({out.get(key + '_file')}), "
                f"not the {ctx.target.kind} processor"
            )
    if out.get("torch_imported"):
        problems.append("torch was imported")
    if out.get("compass_compat_imported") and not vendored:
        problems.append("the probe imported compass_compat")
    if problems:
        return result(ctx, item, FAIL, "torch hidden: " + "; ".join(problems), out)
    note = ""
    if not vendored:
        bare = " ".join(str(out.get("bare_auto_processor")).split()).split(". ")[0]
        note = f"\n(info: AutoProcessor called before mlx-vlm imports the package gives {bare})"
    return result(
        ctx,
        item,
        PASS,
        f"torch hidden: mlx_vlm.load, and AutoProcessor after the package import, give "
        f"{out['auto_processor']}; {name} -> pixel_values {out.get('pixel_values_shape')}; "
        f"torch never imported" + note,
        out,
    )
