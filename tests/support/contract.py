"""The caller contract's drivers (docs/model-contract.md): each calls a model the way one kind
of caller does and returns the logits of the prompt's last token and of each teacher-forced
decode step. Used on ours by tests/test_caller_contract.py, against the recorded transformers
fixtures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import numpy as np

from tests.support.cases import case_inputs

TOL = 1e-4
STEPS = 10  # decode steps: the tiny model's sliding window (8) wraps
CHUNK = 5
# The attribute our language model keeps a request's delta under, on its first-layer cache.
KEPT = "compass_positions"  # positions.KEPT: a request's position state on its first cache layer


@dataclass
class Case:
    """One prompt: ``ids`` [1, L], its image kwargs, and what the reference says it gives."""

    name: str
    ids: mx.array
    pixels: Optional[mx.array]
    extra: Dict[str, Any]
    prefill_last: np.ndarray  # [V]
    step_logits: np.ndarray  # [STEPS, V]: row 0 = prefill_last, row i = after feeding token i-1
    greedy: List[int]  # [STEPS]
    delta: int  # the reference's rope delta (0 for text)
    vision_end: int  # index just past the last vision token (0 for text)

    @property
    def length(self) -> int:
        return int(self.ids.shape[1])

    @property
    def has_image(self) -> bool:
        return self.pixels is not None


def reference_case(reference, name: str) -> Case:
    """Case ``name`` of the recorded transformers fixtures (ours)."""
    case = reference(name)
    ids, pixels, extra = case_inputs(case)
    types = np.asarray(case.get("mm_token_type_ids", np.zeros_like(case["input_ids"])))[0]
    vision = np.nonzero(types)[0]
    return Case(
        name=name,
        ids=ids,
        pixels=pixels,
        extra=extra,
        prefill_last=np.asarray(case["prefill_logits"])[-1],
        step_logits=np.asarray(case["greedy_logits"])[:STEPS],
        greedy=[int(t) for t in case["greedy_ids"][:STEPS]],
        delta=int(np.asarray(case["rope_deltas"]).reshape(-1)[0]) if "rope_deltas" in case else 0,
        vision_end=int(vision[-1]) + 1 if len(vision) else 0,
    )


def check(case: Case, rows: List[np.ndarray], what: str) -> None:
    got = np.stack(rows)
    want = case.step_logits[: len(rows)]
    diff = float(np.abs(got - want).max())
    assert diff < TOL, f"{what} on {case.name}: max |logits - reference| = {diff:.3g}"
    assert got.argmax(-1).tolist() == case.greedy[: len(rows)], f"{what} on {case.name}: greedy ids differ"


def last(out) -> np.ndarray:
    return np.array(out.logits[0, -1])


# ------------------------------------------------------------------------- decode styles
# Each takes (model, cache, token, case, step) and returns the language model's output.


def decode_plain(model, cache, token, case, step):
    return model.language_model(mx.array([[token]]), cache=cache)


def decode_rope_deltas(model, cache, token, case, step):
    return model.language_model(mx.array([[token]]), cache=cache, rope_deltas=mx.array([[case.delta]]))


def decode_positions(model, cache, token, case, step):
    """oMLX-style: absolute positions, offset + delta, per row."""
    pos = case.length + step + case.delta
    return model.language_model(mx.array([[token]]), cache=cache, position_ids=mx.full((3, 1, 1), pos, mx.int32))


def decode_vmlx(model, cache, token, case, step):
    """vMLX: cache offset + arange, plus the request's delta only if the model declares it."""
    adds = getattr(model.language_model, "decode_positions_add_request_rope_delta", False)
    pos = case.length + step + (case.delta if adds else 0)
    return model.language_model(mx.array([[token]]), cache=cache, position_ids=mx.full((3, 1, 1), pos, mx.int32))


DECODES: Dict[str, Callable] = {
    "neither": decode_plain,
    "rope_deltas": decode_rope_deltas,
    "position_ids": decode_positions,
    "vmlx": decode_vmlx,
}


def run_decode(model, cache, case: Case, first: np.ndarray, style: Callable, steps: int = STEPS) -> List[np.ndarray]:
    rows = [first]
    for step, token in enumerate(case.greedy[: steps - 1]):
        rows.append(last(style(model, cache, token, case, step)))
    return rows


# ------------------------------------------------------------------------ prefill styles


def prefill_whole(model, case: Case, cache) -> np.ndarray:
    """oMLX: ``Model.__call__`` on the whole prompt."""
    return last(model(case.ids, case.pixels, cache=cache, **case.extra))


def prefill_model_chunks(model, case: Case, cache) -> np.ndarray:
    """Rapid-MLX's text prefill: ``model(ids[:, s:s+n], cache=cache, pixel_values=None)``."""
    out = None
    for s in range(0, case.length, CHUNK):
        out = model(case.ids[:, s : s + CHUNK], cache=cache, pixel_values=None)
    return last(out)


def prefill_lm_chunks(model, case: Case, cache) -> np.ndarray:
    """mlx-vlm >= 0.4 generate: embeddings once, the language model per chunk with the
    whole prompt's other outputs (positions, deltas, deepstack)."""
    emb = model.get_input_embeddings(case.ids, case.pixels, **case.extra)
    kwargs = {k: v for k, v in emb.to_dict().items() if v is not None and k != "inputs_embeds"}
    out = None
    for s in range(0, case.length, CHUNK):
        out = model.language_model(
            case.ids[:, s : s + CHUNK], inputs_embeds=emb.inputs_embeds[:, s : s + CHUNK], cache=cache, **kwargs
        )
    return last(out)


SUFFIX_MODES = ("embedded-alone", "model-call", "primed")


def prefix_then_suffix(model, case: Case, cache, split: int, mode: str) -> np.ndarray:
    """A cache holding the prompt's first ``split`` tokens (restored from a prefix cache),
    then the text suffix: embedded alone and passed on as the host got it (LM Studio,
    ``embedded-alone``), through ``Model.__call__`` (``model-call``), or as mlx-vlm 0.6.x's
    generate does after a prefix-cache trim (``primed``: the whole prompt's delta passed to
    ``get_input_embeddings``, whose non-None outputs then update the kwargs)."""
    prefix = case.ids[:, :split]
    types = case.extra.get("mm_token_type_ids")
    extra = {**case.extra, "mm_token_type_ids": types[:, :split]} if types is not None else case.extra
    mx.eval(model(prefix, case.pixels, cache=cache, **extra).logits)
    suffix = case.ids[:, split:]
    if mode == "model-call":
        return last(model(suffix, cache=cache))
    kwargs: Dict[str, Any] = {"rope_deltas": mx.array([[case.delta]])} if mode == "primed" else {}
    emb = model.get_input_embeddings(suffix, None, **kwargs)
    kwargs.update({k: v for k, v in emb.to_dict().items() if v is not None and k != "inputs_embeds"})
    return last(model.language_model(suffix, inputs_embeds=emb.inputs_embeds, cache=cache, **kwargs))


def one_row_batch_cache(model) -> List[Any]:
    """Rapid-MLX's one-at-a-time lane: a one-row batch cache (no left padding)."""
    from mlx_lm.models import cache as lm_cache

    return [
        lm_cache.BatchRotatingKVCache(layer.self_attn.window, [0])
        if getattr(layer, "layer_type", None) == "sliding_attention"
        else lm_cache.BatchKVCache([0])
        for layer in model.language_model.layers
    ]


def has_batch_caches() -> bool:
    try:
        from mlx_lm.models import cache as lm_cache
    except ImportError:
        return False
    return hasattr(lm_cache, "BatchKVCache") and hasattr(lm_cache, "BatchRotatingKVCache")


def make_cache(model) -> List[Any]:
    """A fresh prompt cache as mlx-vlm's generate makes it (models without their own
    ``make_cache``, such as qwen3_vl, get one ``KVCache`` per layer)."""
    make = getattr(model.language_model, "make_cache", None)
    if make is not None:
        return make()
    from mlx_vlm.models.cache import KVCache

    return [KVCache() for _ in model.language_model.layers]


def forget_kept_delta(cache: List[Any]) -> None:
    """As a cache rebuilt from its state: no delta kept with it."""
    vars(cache[0]).pop(KEPT, None)


# --------------------------------------------------------------------------------- the items
# Each drives one contract item on one model and checks it against that case's reference.


def item_whole(model, case: Case, style: str) -> None:
    """Whole prefill through ``Model.__call__``, then decode in one of :data:`DECODES`."""
    cache = make_cache(model)
    check(case, run_decode(model, cache, case, prefill_whole(model, case, cache), DECODES[style]), f"decode {style}")


def item_model_chunks(model, case: Case) -> None:
    cache = make_cache(model)
    check(case, run_decode(model, cache, case, prefill_model_chunks(model, case, cache), decode_plain), "chunks")


def item_lm_chunks(model, case: Case) -> None:
    cache = make_cache(model)
    check(case, run_decode(model, cache, case, prefill_lm_chunks(model, case, cache), decode_plain), "lm chunks")


def item_restored(model, case: Case, split: int, mode: str) -> None:
    cache = make_cache(model)
    first = prefix_then_suffix(model, case, cache, split, mode)
    check(case, run_decode(model, cache, case, first, decode_plain), f"restored prefix ({mode})")


def item_one_row_batch(model, case: Case, installed_delta: bool = False) -> None:
    """Prefill and decode in a one-row batch cache, nothing passed at decode; with
    ``installed_delta`` the cache keeps no delta and the host installs the request's on the
    language model (Rapid-MLX's media lane)."""
    cache = one_row_batch_cache(model)
    first = prefill_whole(model, case, cache)
    if installed_delta:
        forget_kept_delta(cache)
        model.language_model._rope_deltas = mx.array([[case.delta]])
    check(case, run_decode(model, cache, case, first, decode_plain), "one-row batch")


def item_rebuilt_after_its_prefill(model, case: Case) -> None:
    """A host rebuilds the request's cache right after its prefill (nothing of ours kept with it:
    Rapid-MLX merges caches of its own class into the pin's batch cache) and decodes with nothing
    passed: the delta that prefill published on the language model is this request's."""
    cache = make_cache(model)
    first = prefill_whole(model, case, cache)
    forget_kept_delta(cache)
    check(case, run_decode(model, cache, case, first, decode_plain), "rebuilt after its prefill")


def item_restored_text_after_a_picture(model, text: Case, picture: Case, split: int) -> None:
    """Rapid-MLX's exact prefix cache for text prompts: the prompt's first ``split`` tokens come
    from a snapshot the host restored (saved to disk by an earlier server: nothing of ours kept
    with it), and the request served just before was a picture's, whose delta the language model
    published. The suffix through ``Model.__call__`` (``pixel_values=None``) and the decode
    (nothing passed) follow the offset: the picture's delta is another request's."""
    snapshot = make_cache(model)
    mx.eval(model(text.ids[:, :split], cache=snapshot, pixel_values=None).logits)
    forget_kept_delta(snapshot)
    other = make_cache(model)
    run_decode(model, other, picture, prefill_whole(model, picture, other), decode_plain, steps=3)
    first = last(model(text.ids[:, split:], cache=snapshot, pixel_values=None))
    check(text, run_decode(model, snapshot, text, first, decode_plain), "restored text prefix after a picture")


def item_interleaved(model, picture: Case, text: Case, style: str) -> None:
    """Two requests on their own caches, prefilled in turn, then decoded a step each in turn."""
    caches = {c.name: make_cache(model) for c in (picture, text)}
    rows = {c.name: [prefill_whole(model, c, caches[c.name])] for c in (picture, text)}
    for step in range(STEPS - 1):
        for case in (picture, text):
            rows[case.name].append(last(DECODES[style](model, caches[case.name], case.greedy[step], case, step)))
    check(picture, rows[picture.name], f"interleaved ({style})")
    check(text, rows[text.name], f"interleaved ({style})")


def merge_caches(caches: List[List[Any]]) -> List[Any]:
    """Rapid-MLX and mlx-lm's batch generator: each layer's request caches merged into one batch
    cache by the first request's cache class (``cache[i].merge([...])``)."""
    return [caches[0][i].merge([c[i] for c in caches]) for i in range(len(caches[0]))]


def item_merged(model, cases: List[Case], finish_at: int = 3, extract_at: int = 6) -> None:
    """Requests prefilled alone on caches of their own, merged into one batch cache and decoded
    together with nothing but the cache (Rapid-MLX's default batching). At step ``finish_at``
    the first row finishes (``filter``); at ``extract_at`` the last row is taken out of the
    batch (``extract``) and decoded alone to the end, the others in the batch."""
    caches = [make_cache(model) for _ in cases]
    rows: List[List[np.ndarray]] = [[prefill_whole(model, c, cache)] for c, cache in zip(cases, caches)]
    batch = merge_caches(caches)
    live = list(range(len(cases)))
    alone: Optional[List[Any]] = None
    for step in range(STEPS - 1):
        if step == finish_at:
            live = live[1:]
            for c in batch:
                c.filter(mx.array(list(range(1, len(live) + 1)), dtype=mx.int32))
        if step == extract_at:
            alone = [c.extract(len(live) - 1) for c in batch]
            for c in batch:
                c.filter(mx.array(list(range(len(live) - 1)), dtype=mx.int32))
        batched = live[:-1] if alone is not None else live
        if batched:
            out = model.language_model(mx.array([[cases[i].greedy[step]] for i in batched]), cache=batch)
            for row, i in enumerate(batched):
                rows[i].append(np.array(out.logits[row, -1]))
        if alone is not None:
            rows[live[-1]].append(last(model.language_model(mx.array([[cases[live[-1]].greedy[step]]]), cache=alone)))
    for i, case in enumerate(cases):
        check(case, rows[i], "merged batch")


def restored_from_snapshot(cache: List[Any]) -> List[Any]:
    """As Rapid-MLX restores a saved prefix: each layer rebuilt from its state as the pin's own
    class (``mlx_vlm.models.cache``), nothing of ours kept."""
    from mlx_vlm.models import cache as pin

    restored = []
    for c in cache:
        rotating = hasattr(c, "max_size")
        new = pin.RotatingKVCache(max_size=c.max_size, keep=c.keep) if rotating else pin.KVCache()
        new.state = c.state
        if rotating:
            new.meta_state = c.meta_state
        restored.append(new)
    return restored


def item_merged_after_a_restored_text_prefix(model, text: Case, pictures: List[Case], split: int) -> None:
    """Rapid-MLX's default batching after a restart with its prefix snapshot: the text prompt's
    first ``split`` tokens restored into caches of the pin's own class, its suffix through
    ``Model.__call__`` (``pixel_values=None``), the pictures prefilled on the model's caches, all
    merged by the text cache's class (first in the batch) and decoded with nothing but the cache."""
    saved = make_cache(model)
    mx.eval(model(text.ids[:, :split], cache=saved, pixel_values=None).logits)
    restored = restored_from_snapshot(saved)
    caches = [restored] + [make_cache(model) for _ in pictures]
    rows = [[last(model(text.ids[:, split:], cache=restored, pixel_values=None))]]
    rows += [[prefill_whole(model, c, cache)] for c, cache in zip(pictures, caches[1:])]
    batch = merge_caches(caches)
    cases = [text] + pictures
    for step in range(STEPS - 1):
        out = model.language_model(mx.array([[c.greedy[step]] for c in cases]), cache=batch)
        for row in range(len(cases)):
            rows[row].append(np.array(out.logits[row, -1]))
    for case, got in zip(cases, rows):
        check(case, got, "merged after a restored text prefix")


def make_cache_class() -> type:
    """The request cache class mlx-vlm's generate makes on this pin (``merge`` where it batches)."""
    from mlx_vlm.models.cache import KVCache

    return KVCache
