"""Print the quantization-mode probes next to the version thresholds they replaced (one JSON line per mode).

Run with a matrix environment: PYTHONPATH=. .venvs/mlxvlm-<env>/bin/python scripts/pin_bump/probe_table.py
(benchmarks/pin-bump/probes.md holds the table measured on every environment).
"""

from __future__ import annotations

import importlib.metadata as m
import json
import re

import mlx.core as mx

import compass_compat
from compass_compat import probes

OLD_MIN_MLX_VLM = (0, 4, 4)
OLD_MIN_MLX = {"mxfp4": (0, 30, 0), "mxfp8": (0, 31, 2), "nvfp4": (0, 31, 2)}


def vt(text):
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


vlm, mlx = m.version("mlx-vlm"), m.version("mlx")
info = compass_compat.implementation_info()
for mode, g, b in (("mxfp4", 32, 4), ("mxfp8", 32, 8), ("nvfp4", 16, 4)):
    kernel, loader = probes.quant_kernel(mode, g, b), probes.loader_passes_mode(mode, g, b)
    diff = re.search(r"= ([0-9.e+-]+) on outputs up to ([0-9.e+-]+)", kernel.evidence)
    old_l, old_k = vt(vlm) < OLD_MIN_MLX_VLM, vt(mlx) < OLD_MIN_MLX[mode]
    probe_refuses, old_refuses = loader.broken or kernel.broken, old_l or old_k
    print(
        json.dumps(
            dict(
                vlm=vlm,
                mlx=mlx,
                live=info.implementation,
                device=str(mx.default_device()),
                mode=mode,
                loader=loader.ok,
                kernel=kernel.ok,
                diff=diff.group(1) if diff else kernel.evidence,
                scale=diff.group(2) if diff else "",
                probe="refuse" if probe_refuses else "load",
                threshold="refuse" if old_refuses else "load",
                agree=probe_refuses == old_refuses and loader.broken == old_l and kernel.broken == old_k,
            )
        )
    )
