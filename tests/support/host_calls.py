"""A checkpoint folder as a host loads and runs it: ``mlx_vlm.load`` afresh on every call, greedy
token ids through mlx-vlm's own ``stream_generate``."""

from __future__ import annotations

from typing import Optional

from tests.support.mlx_vlm_run import greedy_ids

MAX_TOKENS = 16


def load(path, **kwargs):
    """``mlx_vlm.load(path, **kwargs)``, a new load each time (what a failing load leaves behind is tested)."""
    from mlx_vlm import load as mlx_vlm_load

    return mlx_vlm_load(str(path), **kwargs)


def generate(loaded, prompt: str, images=None, max_tokens: int = MAX_TOKENS, fed: Optional[list] = None, **kwargs):
    """Greedy token ids through mlx-vlm's own stream_generate (what hosts call)."""
    return greedy_ids(loaded, prompt, images, max_tokens, fed=fed, **kwargs)
