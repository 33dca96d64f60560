"""Speculative decoding through the pin's ``generate_step`` (``draft_model`` / ``draft_kind``) with a
random drafter of the pin's own dflash architecture, for tests/test_speculative.py (ours, upstream's
cohere_compass). A drafter's quality does not matter: greedy speculative decoding must give the plain greedy tokens or not run.
"""

from __future__ import annotations

import inspect
import traceback
from typing import Iterator, List

import mlx.core as mx

STEPS = 6
PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11, 12]


def speculative_pin() -> bool:
    """Whether the pin's ``generate_step`` takes a ``draft_model``."""
    from mlx_vlm.generate import generate_step

    return "draft_model" in inspect.signature(generate_step).parameters


def draft_kinds() -> List[str]:
    """The pin's drafter kinds (dflash, eagle3, mtp, ...)."""
    from mlx_vlm.speculative.drafters import KNOWN_DRAFTER_KINDS

    return sorted(KNOWN_DRAFTER_KINDS)


def drafter_for(model):
    """The pin's dflash drafter with random weights, sized for ``model``'s decoder."""
    from mlx_vlm.speculative.drafters.qwen3_dflash.config import DFlashConfig
    from mlx_vlm.speculative.drafters.qwen3_dflash.dflash import DFlashDraftModel

    lm = model.language_model
    layers = len(lm.model.layers)
    vocab, hidden = lm.model.embed_tokens.weight.shape
    config = DFlashConfig.from_dict(
        dict(
            model_type="qwen3_dflash",
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=vocab,
            block_size=4,
            mask_token_id=vocab - 1,
            target_layer_ids=[0, layers - 1],
            num_target_layers=layers,
        )
    )
    drafter = DFlashDraftModel(config)
    mx.eval(drafter.parameters())
    return drafter


def token_stream(model, **kwargs) -> Iterator[int]:
    """The pin's ``generate_step`` on a text prompt, greedy, yielding token ids."""
    from mlx_vlm.generate import generate_step

    stream = generate_step(mx.array([PROMPT_IDS]), model, None, None, max_tokens=STEPS, temperature=0.0, **kwargs)
    return (int(mx.array(token).reshape(-1)[0].item()) for token, _ in stream)


def step_tokens(model, **kwargs) -> List[int]:
    """The first :data:`STEPS` greedy ids of :func:`token_stream`."""
    return list(token_stream(model, **kwargs))[:STEPS]


def outcome(model, kind: str) -> str:
    """'equal to plain greedy' (speculative greedy == plain greedy) or the failure, which must be
    raised inside mlx-vlm's speculative package (the pin's)."""
    plain = step_tokens(model)
    yielded = []
    try:
        for token in token_stream(model, draft_model=drafter_for(model), draft_kind=kind):
            yielded.append(token)
    except Exception as error:
        where = traceback.extract_tb(error.__traceback__)[-1]
        frames = [f.filename.replace("\\", "/") for f in traceback.extract_tb(error.__traceback__)]
        assert any("/mlx_vlm/speculative/" in f for f in frames), f"{kind} failed outside mlx-vlm's speculative code"
        return (
            f"fails after {len(yielded)} token(s): {type(error).__name__} at "
            f"{where.filename.split('site-packages/')[-1]}:{where.lineno}"
        )
    assert yielded[:STEPS] == plain, f"{kind}: speculative greedy {yielded} != plain greedy {plain}"
    return "equal to plain greedy"
