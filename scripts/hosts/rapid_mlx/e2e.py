#!/usr/bin/env python3
"""End to end: Rapid-MLX 0.16.10 `[vision]` (`rapid-mlx serve`) serving compass-compat's default
checkpoint through the opt-in hook, every answer checked against `python -m compass_compat generate`
for the same messages.

Run it with the environment's interpreter (scripts/hosts/rapid_mlx/env.sh builds it):

    .venvs/rapid_mlx-0.16.10/bin/python scripts/hosts/rapid_mlx/e2e.py [--phase default|lane] [--source DIR]

mlx-vlm 0.7.2 ships its own cohere_compass; the server runs with COMPASS_COMPAT_AUTOPATCH=1 alone,
and the recorded verdicts make the vendored package live there (upstream's fails the checklist). `--mllm` makes Rapid-MLX
load the folder as a vision model (its auto-detection goes by model name). Three server starts:

- `default`: Rapid-MLX's defaults (continuous batching of up to 256 sequences);
- `lane`: its one-at-a-time lane, `--max-num-seqs 1 --prefill-batch-size 1
  --completion-batch-size 1` (the structural single-request path, mllm_scheduler.py);
- `restart`: its defaults again on the same model copy, starting from the prefix snapshot the
  phases before saved at shutdown (restored text prompts batched with picture requests).

Each gets the standard request set (scripts/hosts/common/e2e.py) plus Rapid-MLX's own path: a
long text prompt (about 2180 tokens), which it prefills in chunks of `--prefill-step-size`
(default 2048) through `model(ids[:, pos:pos+n], cache=cache, pixel_values=None)`
(mllm_batch_generator.py), relying on the model to take positions from the cache offset.
Output: build/hosts/rapid_mlx/{results.json,table.md,serve-*.log}.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from scripts.hosts.common.e2e import Case, Host, Phase, console_script, long_text, main, standard_cases  # noqa: E402

LANE = ["--max-num-seqs", "1", "--prefill-batch-size", "1", "--completion-batch-size", "1"]


def cases() -> List[Case]:
    return standard_cases() + [Case("L", [], long_text(), "long text (~2180 tokens): chunked prefill")]


def command(model_dir: Path, port: int) -> List[str]:
    return [
        *console_script("rapid-mlx"), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", model_dir.name, "--mllm",
    ]  # fmt: skip


HOST = Host(
    name="rapid_mlx",
    label="Rapid-MLX 0.16.10 [vision]",
    distributions=["rapid-mlx", "mlx", "mlx-vlm", "mlx-lm", "transformers", "torch"],
    command=command,
    ready_path="/healthz",
    ready_check=lambda r: None if r.get("ready") and r.get("model_loaded") else f"healthz says {r}",
    env={"DO_NOT_TRACK": "1"},  # no telemetry attempts
    phases=lambda: [
        Phase("default", cases(), note="Rapid-MLX's defaults"),
        Phase("lane", cases(), args=LANE, note="one request at a time"),
        # Its defaults again on the same model copy: the prefix snapshot the two phases saved at
        # shutdown is loaded, so restored text prompts are batched with picture requests.
        Phase("restart", cases(), note="Rapid-MLX's defaults after a restart with its prefix snapshot"),
    ],
)

if __name__ == "__main__":
    sys.exit(main(HOST))
