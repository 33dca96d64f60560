"""In-process runs of ``python -m compass_compat generate`` for tests that compare with it."""

from __future__ import annotations

import contextlib
import io
from typing import Optional


def greedy_cli_output(model, prompt: str, max_tokens: int, image: Optional[object] = None) -> str:
    """What the CLI prints on stdout for a greedy run (``--no-verbose``: the text alone)."""
    from compass_compat import cli

    argv = ["generate", "--model", str(model)]
    argv += ["--image", str(image)] if image is not None else ["--no-image"]
    argv += ["--prompt", prompt, "--max-tokens", str(max_tokens), "--temperature", "0", "--no-verbose"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    assert code == 0, f"compass_compat generate exited {code}: {argv}"
    return out.getvalue()
