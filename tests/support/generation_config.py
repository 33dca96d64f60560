"""Checkpoint copies with a given generation_config.json, and what this pin's own mlx-vlm generates
on them (``mlx_vlm.load`` + ``stream_generate``, seeded): the expectations of the CLI's sampling
tests, never taken from ``compass_compat.cli``.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import List, NamedTuple, Optional

from compass_data.tiny import tiny_generation_config

PROMPT = "Describe this picture."
MAX_TOKENS = 12
# The sampling keys of CohereLabs/North-Micro-Vision-Instruct's generation_config.json.
PUBLISHED = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20)
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

# generation_config.json contents (None: no file); ids from the tiny tokenizer.
GENERATION_CONFIGS = {
    "published": lambda ids: {**ids, **PUBLISHED},
    "do_sample_false": lambda ids: {**ids, **PUBLISHED, "do_sample": False},
    "ids_only": lambda ids: dict(ids),
    "absent": lambda ids: None,
}


class Run(NamedTuple):
    """What one generation gave: its text and its token ids."""

    text: str
    ids: List[int]


def token_ids() -> dict:
    """The tiny checkpoint's bos / eos / pad ids, as generation_config.json names them."""
    ids = tiny_generation_config()
    return {key: ids[key] for key in ID_KEYS}


def with_generation_config(base: Path, where: Path, content: Optional[dict]) -> Path:
    """A copy of ``base`` whose generation_config.json is ``content`` (None: the file removed)."""
    path = where / "ckpt"
    shutil.copytree(base, path)
    target = path / "generation_config.json"
    if content is None:
        target.unlink(missing_ok=True)
    else:
        target.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    return path


@functools.lru_cache(maxsize=None)
def loaded(path: str):
    """``mlx_vlm.load`` once per folder."""
    from mlx_vlm import load

    return load(path)


def mlx_vlm_run(path: Path, seed: int = 0, **sampling) -> Run:
    """mlx-vlm's own generate on ``path``: the CLI's prompt, text only, seeded right before generating."""
    # Not cases.stream_ids: this samples (seeded) and keeps the streamed text too.
    import mlx.core as mx
    from mlx_vlm import stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = loaded(str(path))
    prompt = apply_chat_template(processor, model.config, PROMPT, num_images=0)
    mx.random.seed(seed)
    pieces, seen = [], {}
    for result in stream_generate(model, processor, prompt, max_tokens=MAX_TOKENS, **sampling):
        pieces.append(result.text)
        seen.setdefault(result.generation_tokens, int(result.token))  # a token once, whatever the pin yields
    return Run("".join(pieces), [seen[k] for k in sorted(seen)])
