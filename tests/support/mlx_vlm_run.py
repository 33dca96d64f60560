"""mlx-vlm's own ``load`` and greedy ``stream_generate``, for tests and scripts that drive a folder as a host does."""

from __future__ import annotations

import functools
from typing import Optional, Sequence

from tests.support.cases import stream_ids


@functools.lru_cache(maxsize=None)
def load(path: str):
    """``mlx_vlm.load`` once per folder (tests compare several runs of the same checkpoint)."""
    from mlx_vlm import load as mlx_vlm_load

    return mlx_vlm_load(str(path))


def chat_prompt(loaded, text: str, num_images: int) -> str:
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = loaded
    return apply_chat_template(processor, model.config, text, num_images=num_images)


def greedy_ids(loaded, prompt: str, images: Optional[Sequence] = None, max_tokens: int = 32, **kwargs):
    """Greedy ids of ``stream_generate`` on an already-templated ``prompt``; ``loaded`` is (model,
    processor). ``fed=[...]`` collects what the model received (see ``harness.stream_ids``)."""
    model, processor = loaded
    return stream_ids(model, processor, prompt, [str(i) for i in images or ()], max_tokens, **kwargs)


def answer_ids(path, text: str, image=None, max_tokens: int = 32):
    """Greedy ids for one user turn (``text``, at most one image) on the folder ``path``."""
    loaded = load(str(path))
    prompt = chat_prompt(loaded, text, 1 if image else 0)
    return greedy_ids(loaded, prompt, [image] if image else None, max_tokens)
