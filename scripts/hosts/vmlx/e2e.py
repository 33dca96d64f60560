#!/usr/bin/env python3
"""End to end: vMLX 1.6.81 (`vmlx serve`) against `python -m compass_compat generate`
(scripts/hosts/common/e2e.py; run by scripts/hosts/vmlx/run.sh).

The server runs with VMLX_GPU_KEEPALIVE=0: vMLX starts a "GPU keepalive" thread on its first
request that makes an `mx.gpu` stream, which a CPU-only mlx does not have (a host defect; the
variable is vMLX's own switch, docs/hosts.md). Every picture answer goes through vMLX's own decode
(mllm_batch_generator.py), which passes absolute positions (cache offset + arange) and adds a
request's MRoPE delta only for language models that declare
`decode_positions_add_request_rope_delta = True`. Two server starts: vMLX's defaults (continuous
batching, one sequence at a time) and `--max-num-seqs 4` (rows decoded together).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from scripts.hosts.common.e2e import (  # noqa: E402
    MODEL_ID,
    Host,
    Phase,
    console_script,
    main,
    standard_cases,
)


def command(model_dir: Path, port: int) -> List[str]:
    serve = ["serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_ID]
    return console_script("vmlx") + serve


HOST = Host(
    name="vmlx",
    label="vMLX 1.6.81",
    distributions=["vmlx", "mlx", "mlx-vlm", "mlx-lm", "transformers", "torch"],
    command=command,
    env={"VMLX_GPU_KEEPALIVE": "0"},
    phases=lambda: [
        Phase("default", standard_cases(), note="vMLX's defaults"),
        Phase("batch4", standard_cases(), args=["--max-num-seqs", "4"], note="rows decoded together"),
    ],
)

if __name__ == "__main__":
    sys.exit(main(HOST))
