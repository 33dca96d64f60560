#!/usr/bin/env python3
"""End to end: Rapid-MLX 0.16.10 `[vision]` (`rapid-mlx serve`) against `python -m compass_compat generate`
(scripts/hosts/common/e2e.py; run by scripts/hosts/rapid_mlx/run.sh).

`--mllm` makes Rapid-MLX load the folder as a vision model (its auto-detection goes by model name).
Three server starts:

- `default`: Rapid-MLX's defaults (continuous batching of up to 256 sequences);
- `lane`: its one-at-a-time lane, `--max-num-seqs 1 --prefill-batch-size 1
  --completion-batch-size 1` (the structural single-request path, mllm_scheduler.py);
- `restart`: its defaults again on the same model copy, starting from the prefix snapshot the
  phases before saved at shutdown (restored text prompts batched with picture requests).

Each gets the standard request set plus Rapid-MLX's own path: a long text prompt (about 2180
tokens), which it prefills in chunks of `--prefill-step-size` (default 2048) through
`model(ids[:, pos:pos+n], cache=cache, pixel_values=None)` (mllm_batch_generator.py), relying on
the model to take positions from the cache offset.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from scripts.hosts.common.e2e import Case, Host, Phase, console_script, main, standard_cases  # noqa: E402

LANE = ["--max-num-seqs", "1", "--prefill-batch-size", "1", "--completion-batch-size", "1"]


def long_text(words: int = 1250) -> str:
    """About 2180 tokens on the toy's tokenizer: past a 2048-token prefill step and the 640-token window."""
    base = (
        "The sea was calm and the wind was low, and the sky over the harbour turned from blue to "
        "grey as the boats came home one by one. "
    )
    return base * -(-words // len(base.split())) + "What did the boats do?"


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
        Phase("restart", cases(), note="Rapid-MLX's defaults after a restart with its prefix snapshot"),
    ],
)

if __name__ == "__main__":
    sys.exit(main(HOST))
