#!/usr/bin/env python3
"""End to end: LM Studio's MLX engine (mlx-engine 08f0c07, `python -m mlx_engine.server`) against
`python -m compass_compat generate` (scripts/hosts/common/e2e.py; run by scripts/hosts/lmstudio/run.sh).

The engine's server streams only and requires `top_k` and a bearer key (MLX_ENGINE_API_KEY, a
throw-away value). Besides the standard request set it gets the engine's own path: text prompts
whose start its prompt cache already holds from an earlier request (the engine then embeds only
the uncached suffix, `model_kit/batched_vision/prompt_inputs.py`), one of them repeated whole.
"""

from __future__ import annotations

import re
import secrets
import sys
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from scripts.hosts.common.e2e import Case, Host, Phase, main, standard_cases  # noqa: E402

KEY = secrets.token_hex(8)  # the server refuses to start without one; loopback only


def restored_prefix_cases() -> List[Case]:
    """Text prompts that share their start with an earlier request of the run.

    How much of each the engine restores is its choice (the notes show what it logged); the
    chat template's start at least, the shared words when its cache still holds them.
    """
    what = "text, start shared with"
    return [
        Case("p1", [], "Tell me about the sea.", f"{what} b (template)"),
        Case("p2", [], "Tell me about the sea and the wind.", f"{what} p1"),
        Case("p3", [], "Tell me about the sea and the wind at night.", f"{what} p2"),
        Case("p4", [], "Tell me about the sky.", f"{what} p1-p3"),
        Case("p5", [], "Say hello to the sea.", f"{what} b"),
        Case("p6", [], "Write one sentence about the sea.", f"{what} f2"),
        Case("p7", [], "Tell me about the sea.", "= p1 again"),
    ]


def command(model_dir: Path, port: int) -> List[str]:
    return [
        sys.executable, "-m", "mlx_engine.server", "--model", str(model_dir), "--host", "127.0.0.1",
        "--port", str(port), "--context-length", "4096", "--parallel-sessions", "4",
    ]  # fmt: skip


def body(b: Dict[str, Any], case: Case) -> Dict[str, Any]:
    b.pop("stream_options", None)
    return dict(b, top_k=0)  # required by its schema; 0 = off (temperature 0 is argmax anyway)


def cache_notes(segment: str) -> List[str]:
    """What the engine's prompt cache restored for the request (its coordinator's INFO lines)."""
    found = re.findall(r"Prompt cache restore: cached_tokens=(\d+) uncached_tokens=(\d+)", segment)
    return [f"prompt cache: {c} of {int(c) + int(u)} tokens restored" for c, u in found]


HOST = Host(
    name="lmstudio",
    label="LM Studio's engine (mlx-engine 08f0c07)",
    distributions=["mlx", "mlx-vlm", "mlx-lm", "transformers", "torch"],
    command=command,
    ready_path="/health",
    ready_check=lambda reply: None if reply.get("status") == "ok" else f"health says {reply}",
    headers={"Authorization": f"Bearer {KEY}"},
    env={"MLX_ENGINE_API_KEY": KEY},
    body=body,
    stream_only=True,
    log_notes=cache_notes,
    phases=lambda: [Phase("default", standard_cases() + restored_prefix_cases())],
)

if __name__ == "__main__":
    sys.exit(main(HOST))
