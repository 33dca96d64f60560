"""Multi-turn conversations through mlx-vlm's own ``stream_generate``, each turn run twice: with
the pin's prompt-cache reuse (a ``PromptCacheState`` kept across turns, or an automatic prefix
cache manager) and as a fresh request of the same whole conversation, with no cache at all.

For tests/test_prompt_cache_reuse.py: ours is driven with prompts and picture files (its processor).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

TOL = 1e-4  # the largest |log-probability - uncached| of a turn that reused a cache

# Each turn: the user's text and the pictures it adds ("demo", "scene": the default picture and a
# rendered shapes scene).
CONVERSATIONS: Dict[str, List[Tuple[str, Tuple[str, ...]]]] = {
    "picture-text-picture": [
        ("Describe this image.", ("demo",)),
        ("How many shapes are there?", ()),
        ("Describe this image.", ("scene",)),
    ],
    "text-only": [("Hello there!", ()), ("What can you do?", ()), ("Tell me more.", ())],
    "text-then-picture": [("Hello there!", ()), ("Describe this image.", ("demo",))],
}


@dataclass
class Turn:
    """What one request gave: greedy ids, each step's log-probabilities, the ids the model was
    fed (the pin trims a reused prefix), and the error it raised, if any."""

    ids: List[int]
    logprobs: Optional[np.ndarray]
    fed: int
    error: Optional[Exception] = None


def prompt_cache_state_class():
    """mlx-vlm's ``PromptCacheState``, or None where the pin has no multi-turn cache reuse."""
    import mlx_vlm

    return getattr(mlx_vlm, "PromptCacheState", None)


def primes_a_restored_prefix() -> bool:
    """Whether the pin primes the whole prompt's positions before it trims a prompt to the
    part after a reused prefix (and reuses only text-only parts): 0.6 and newer."""
    for name in ("mlx_vlm.generate.dispatch", "mlx_vlm.generate"):
        try:
            if hasattr(importlib.import_module(name), "_prime_cached_prefix_rope_state"):
                return True
        except ImportError:
            continue
    return False


def expected_reuse(name: str, turn: int) -> str:
    """What the pin does with turn ``turn`` of conversation ``name``: "fresh" (nothing to reuse),
    "reused" (a prefix restored), "whole" (prefilled whole though a prefix is cached)."""
    adds_picture = bool(CONVERSATIONS[name][turn][1])
    if turn == 0:
        return "fresh"
    if adds_picture and primes_a_restored_prefix():
        return "whole"
    return "reused"


def check_turn(where: str, want: str, cached: Turn, fresh: Turn) -> None:
    """``cached`` did what ``want`` says (:func:`expected_reuse`, or "either": at most the
    uncached run's ids fed) and answered as ``fresh``."""
    assert fresh.error is None, f"{where} uncached: {fresh.error}"
    assert cached.error is None, f"{where}: {cached.error}"
    if want == "either":
        assert cached.fed <= fresh.fed, f"{where}: {cached.fed} of {fresh.fed} ids fed"
    elif want == "reused":
        assert cached.fed < fresh.fed, f"{where}: the pin reused no prefix ({cached.fed} of {fresh.fed} ids fed)"
    else:
        assert cached.fed == fresh.fed, f"{where}: {cached.fed} of {fresh.fed} ids fed"
    assert cached.ids == fresh.ids, f"{where}: {cached.ids} != uncached {fresh.ids}"
    n = len(fresh.ids)
    diff = float(np.abs(cached.logprobs[:n] - fresh.logprobs[:n]).max())
    assert diff < TOL, f"{where}: max |logprobs - uncached| = {diff:.3g}"


def run_turn(model, processor, prompt: str, max_tokens: int, **kwargs: Any) -> Turn:
    """One greedy ``stream_generate`` request; the model's errors are returned, not raised."""
    from mlx_vlm import stream_generate

    fed: List[int] = []
    original = model.get_input_embeddings

    def spy(input_ids=None, *args, **kw):
        fed.append(int(input_ids.shape[-1]))
        return original(input_ids, *args, **kw)

    ids: List[int] = []
    rows: List[np.ndarray] = []
    model.get_input_embeddings = spy
    try:
        for result in stream_generate(model, processor, prompt, max_tokens=max_tokens, temperature=0.0, **kwargs):
            if result.token is not None and len(ids) < int(result.generation_tokens):
                ids.append(int(result.token))
                rows.append(np.array(result.logprobs).reshape(-1))
    except ValueError as error:
        return Turn(ids, None, fed[0] if fed else 0, error)
    finally:
        del model.get_input_embeddings
    return Turn(ids, np.stack(rows) if rows else None, fed[0] if fed else 0)
