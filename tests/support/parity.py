"""Drive a loaded cohere_compass Model the way mlx-vlm does, for parity checks."""

from __future__ import annotations

from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from tests.support.cases import case_inputs, max_abs


def image_kwargs(case: Dict) -> Dict:
    """A case's image inputs as keyword arguments (none for a text case)."""
    _, pixels, extra = case_inputs(case)
    return {} if pixels is None else {"pixel_values": pixels, **extra}


def prefill(model, case: Dict, cache=None, **kwargs) -> mx.array:
    """Prefill logits [L, V] of a reference case through Model.__call__; ``kwargs`` add to or
    replace the case's inputs (``pixel_values=None, cached_image_features=...``)."""
    cache = cache if cache is not None else model.language_model.make_cache()
    ids, pixels, extra = case_inputs(case)
    pixels = kwargs.pop("pixel_values", pixels)
    return model(ids, pixels, cache=cache, **{**extra, **kwargs}).logits[0]


def teacher_forced_decode(model, case: Dict, steps: Optional[int] = None) -> np.ndarray:
    """Logits of each greedy step [steps, V], feeding the reference's greedy ids one at a time."""
    cache = model.language_model.make_cache()
    logits = prefill(model, case, cache)
    rows = [np.array(logits[-1])]
    ids = case["greedy_ids"]
    steps = len(ids) if steps is None else steps
    for token in ids[: steps - 1]:
        out = model.language_model(mx.array([[int(token)]]), cache=cache)
        rows.append(np.array(out.logits[0, -1]))
    return np.stack(rows)


def greedy(model, case: Dict, steps: int, **kwargs) -> List[int]:
    """Greedy ids through the model itself (prefill, then one decoder step a token): the route
    with no mlx-vlm generation code in it. ``kwargs`` as :func:`prefill`'s."""
    cache = model.language_model.make_cache()
    y = int(mx.argmax(prefill(model, case, cache, **kwargs)[-1]).item())
    ids = [y]
    for _ in range(steps - 1):
        out = model.language_model(mx.array([[y]]), cache=cache)
        y = int(mx.argmax(out.logits[0, -1]).item())
        ids.append(y)
    return ids


def chunked_prefill(model, case: Dict, chunk: int) -> mx.array:
    """Prefill in chunks the way mlx-vlm >= 0.4 does: embeddings once, then the
    decoder per chunk with the full-prompt kwargs."""
    cache = model.language_model.make_cache()
    ids, pixels, extra = case_inputs(case)
    emb = model.get_input_embeddings(ids, pixels, **extra)
    extra = {k: v for k, v in emb.to_dict().items() if k != "inputs_embeds" and v is not None}
    rows = []
    L = ids.shape[1]
    for s in range(0, L, chunk):
        out = model.language_model(
            ids[:, s : s + chunk], inputs_embeds=emb.inputs_embeds[:, s : s + chunk], cache=cache, **extra
        )
        rows.append(out.logits[0])
    return mx.concatenate(rows, axis=0)


def assert_prefill_matches(model, case: Dict, name: str, tol: float) -> None:
    diff = max_abs(prefill(model, case), case["prefill_logits"])
    assert diff < tol, f"{name}: max |logits - reference| = {diff:.3g}"


def assert_decode_steps_match(model, case: Dict, name: str, tol: float) -> None:
    """Teacher-forced step logits within ``tol`` of the reference's, and their argmax its greedy ids."""
    got = teacher_forced_decode(model, case)
    diff = max_abs(got, case["greedy_logits"])
    assert diff < tol, f"{name}: max |step logits - reference| = {diff:.3g}"
    assert got.argmax(-1).tolist() == case["greedy_ids"].tolist()
