"""Every training mode of the installed mlx-vlm's own trainer CLI runs a few steps on the tiny checkpoint.

Each mode is a fresh interpreter started by ``scripts/train/probe_modes.py``'s ``run_mode``:
``python -m mlx_vlm.train`` (0.7.x) or ``python -m mlx_vlm.lora`` (0.4.x-0.6.x) with
``COMPASS_COMPAT_AUTOPATCH=1``, 3 steps, batch 1, 4 shape pictures (GRPO: 2 samples of at most 8
tokens per prompt). Expected, per mode the CLI has:

- ok: exit 0 and the adapter or weights file written;
- ``--compile`` (0.7.x) and ORPO on 0.4.x-0.6.x (whose step is always compiled): the model's
  named refusal (it reads token ids on the host), never MLX's bare error;
- a mode the CLI lacks: no flag for it in the CLI's ``--help`` (the table in docs/fine-tuning.md).

A whole file takes about 1 minute per pin on a quiet 2-core machine (0.6.12: 13 s of runs, 0.7.10
forced: 60 s; measured with ``probe_modes.py``).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
from typing import Dict

import mlx.core as mx
import mlx_vlm
import pytest
from packaging.version import Version

from scripts.train import probe_modes
from tests.support.vendored import vendored

REFUSAL = "cohere_compass cannot run under mx.compile"
# What the CLI's --help shows when it has the mode (probe_modes.MODES says which it runs).
HELP_MARKS = {
    "dora": "dora",
    "qlora-from-float": "--quantization-bits",
    "target-modules": "--target-modules",
    "compile": "--compile",
    "dpo": "dpo",
    "grpo": "grpo",
}

vendored()  # skips the module when upstream's cohere_compass is live

if not importlib.util.find_spec(probe_modes.NEW_CLI):
    if Version(mlx_vlm.__version__) < Version("0.5"):
        pytest.skip(
            "mlx-vlm < 0.5's trainer CLI cannot train an image row: 0.4.x's iterate_batches cuts every row "
            "to 33 tokens (docs/fine-tuning.md, section 2)",
            allow_module_level=True,
        )
    if not importlib.util.find_spec("datasets"):
        pytest.skip(
            "python -m mlx_vlm.lora needs `datasets` (mlx-vlm's train extra: pip install 'mlx-vlm[train]')",
            allow_module_level=True,
        )


def compiled(mode: str) -> bool:
    """The modes whose step the pin runs under mx.compile."""
    return mode == "compile" or (mode == "orpo" and probe_modes.cli() == probe_modes.OLD_CLI)


@pytest.fixture(scope="module")
def setup(tiny_ckpt_original, tmp_path_factory) -> Dict[str, object]:
    from transformers import AutoTokenizer

    work = tmp_path_factory.mktemp("modes")
    models = {"float": tiny_ckpt_original, "q4": probe_modes.quantize(tiny_ckpt_original, work / "tiny-q4")}
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt_original)
    models["assistant_id"] = tokenizer.convert_tokens_to_ids("<|CHATBOT_TOKEN|>")
    return {"models": models, "data": probe_modes.write_datasets(work / "data"), "work": work}


@pytest.fixture(scope="module")
def cli_help() -> str:
    # This tree's code first, as probe_modes runs the modes.
    paths = [str(probe_modes.ROOT)] + [
        os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p
    ]
    env = dict(os.environ, COMPASS_COMPAT_AUTOPATCH="1", PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.run(
        [sys.executable, "-m", probe_modes.cli(), "--help"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.lower()


@pytest.mark.parametrize("mode", list(probe_modes.MODES))
def test_training_mode(mode, setup, cli_help):
    if probe_modes.MODES[mode][probe_modes.cli()] is None:
        # The table's "no such mode" holds: the CLI shows no flag for it.
        assert HELP_MARKS[mode] not in cli_help, f"the CLI has {mode} now: add its flags to probe_modes.MODES"
        return
    if compiled(mode) and Version(mx.__version__) < Version("0.32.4"):
        # Measured on mlx 0.31.2 and 0.32.3: the host read is reported only after tracing.
        pytest.skip(f"mlx {mx.__version__} reports a host read under mx.compile outside the model: no named refusal")
    row = probe_modes.run_mode(mode, setup["models"], setup["data"], pathlib.Path(setup["work"]))
    if compiled(mode):
        assert row["result"].startswith(f"ValueError: {REFUSAL}"), row
    else:
        assert row["result"] == "ok", row
