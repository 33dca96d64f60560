"""Where a request's MRoPE positions come from: the one owner of cohere_compass's position state.

Positions are ``[3, B, L]`` (t, h, w). Text advances all three axes by one; a picture's or a
video patch's tokens take the indices of its merged grid (:func:`get_rope_index`), and the text
after it continues at ``column + delta``, the request's rope delta (negative: a picture takes
fewer positions than tokens). A forward needs, per row, explicit positions or a delta to add to
its cache offset. The state that decides which lives in three places, each with one job:

- :class:`Kept`, on the request's first cache layer (attribute ``compass_positions``): the delta its
  tokens continue from (one per row), the column from which that delta holds (past its last
  vision token) and the most tokens a rotating cache held. Batch caches made by ``merge`` carry
  one delta per row through filter, extend and extract (:class:`_KeepsRowDeltas`); a first layer
  a host rebuilt as the pin's rotating class takes the model's at its next forward, so a batch it
  leads carries them too.
- :class:`Issued`, a weak registry of the arrays the model itself handed out: whole-prompt
  positions (they count from column 0), a suffix's positions (they follow ``prefix`` cached
  tokens), deltas (their one value when every row has it), a text prompt's zeros, each delta
  published in ``_rope_deltas`` (the column where the forward that published it ended); and of the
  arrays a host passes whole with every prefill chunk (where each was first seen).
- ``_rope_deltas`` / ``_position_ids`` on the language model: what Qwen-VL models in mlx-vlm
  expose, written for hosts that read them after a prefill; read back only for a cache that
  kept no delta (a host rebuilt it), when its rows match and it is that request's: a host
  installed it, the cache is a batch a host merged, or the forward that published it (marked in
  :class:`Issued` with the column it ended at) ended where this single-sequence cache continues.

What a forward's positions are (:func:`resolve`), by the request's state and what it is given:

| request \\ given | positions | a caller's deltas | the text zeros we issued | nothing |
| --- | --- | --- | --- | --- |
| new (empty cache) | those (this chunk's columns) | offset + delta | offset | offset |
| continuing its cache | those; refused if they count from another column | offset + delta | offset + kept delta if it holds here | offset + kept delta if it holds here |
| cache set back by a host, before the kept delta holds | the same | offset + delta | offset | offset |
| cache a host built (nothing kept) | those | offset + delta | offset | offset + ``_rope_deltas`` if its rows match and it is this request's (a host installed it, the cache is a batch a host merged, or the forward that published it ended where this single-sequence cache continues) |
| batch (per-row offsets) | those; rows only pictures brought are filled from ``position_rows`` | per row | per row | per-row kept deltas |

Every forward keeps the delta its tokens used (the given one, or ``last position + 1 - tokens``
per row after explicit positions) with the cache and in ``_rope_deltas``. A rotating cache set back
after its ring wrapped is refused: it no longer holds the tokens before the cut.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..cache import RotatingKVCache as _PinRotatingKVCache
from .config import grid_sequence

KEPT = "compass_positions"  # the attribute of a request's first cache layer holding its Kept
IMAGE, VIDEO = 1, 2  # mm_token_type_ids values, as the processor writes them


@dataclass
class Kept:
    """A request's position state, on its first cache layer."""

    delta: Any = None  # int, or [rows, 1] mx.array
    since: Any = None  # the column from which ``delta`` holds (int, or a lazy mx scalar); None: all
    reached: int = 0  # the most tokens the cache held (a rotating cache's high mark)


def kept(first: Any) -> Optional[Kept]:
    return getattr(first, KEPT, None) if first is not None else None


def keep(first: Any) -> Optional[Kept]:
    """The Kept of this cache, made if it has none (None for a cache that cannot carry one)."""
    state = kept(first)
    if state is None and first is not None:
        try:
            setattr(first, KEPT, state := Kept())
        except AttributeError:  # a cache class with __slots__: the module state alone
            return None
    return state


def delta_rows(delta: Any) -> Optional[mx.array]:
    """A delta as one int32 value per row (``[rows]``), or None."""
    if delta is None:
        return None
    if isinstance(delta, (int, np.integer)):
        return mx.array([int(delta)], dtype=mx.int32)
    return (
        (delta if isinstance(delta, mx.array) else mx.array(np.asarray(delta)))
        .reshape(-1)
        .astype(mx.int32)
    )


def _row_deltas(cache: Any) -> Optional[mx.array]:
    state = kept(cache)
    return delta_rows(state.delta) if state is not None else None


def _keep_rows(cache: Any, rows: Any) -> None:
    setattr(cache, KEPT, Kept(delta=rows))


class _KeepsRowDeltas:
    """A batch cache made by ``merge`` of this model's request caches: each row's rope delta stays
    with its row through ``filter``, ``extend`` and ``extract``. Hosts that prefill requests one by
    one, merge their caches and decode with nothing but the cache (Rapid-MLX) would otherwise
    decode picture rows at wrong positions."""

    @classmethod
    def merged(cls, caches: List[Any], request_class: type) -> Any:
        """``cls.merge(caches)``; ``extract`` gives back ``request_class`` (the model's own)."""
        batch = cls.merge(caches)
        batch.request_class = request_class
        rows = [_row_deltas(c) for c in caches]
        if all(r is not None for r in rows):
            _keep_rows(batch, mx.concatenate(rows).reshape(-1, 1))
        return batch

    def filter(self, batch_indices: Any) -> None:
        rows = _row_deltas(self)
        super().filter(batch_indices)  # type: ignore[misc]
        if rows is not None:
            _keep_rows(
                self, rows[mx.array(batch_indices).astype(mx.int32)].reshape(-1, 1)
            )

    def extend(self, other: Any) -> None:
        mine, theirs = _row_deltas(self), _row_deltas(other)
        super().extend(other)  # type: ignore[misc]
        _keep_rows(
            self,
            None
            if mine is None or theirs is None
            else mx.concatenate([mine, theirs]).reshape(-1, 1),
        )

    def extract(self, idx: int) -> Any:
        rows = _row_deltas(self)
        single = super().extract(idx)  # type: ignore[misc]
        if rows is not None:
            if type(single) in self.request_class.__bases__:
                single.__class__ = (
                    self.request_class
                )  # same state; keeps merge (and to_quantized) ours
            _keep_rows(single, int(rows[idx].item()))
        return single


# Where the pin batches rotating caches (mlx-lm's class before mlx-vlm 0.6), a merged batch keeps
# each row's delta. Only layer 0 keeps it (a sliding layer in the published layout); full-attention
# layers keep the pin's exact KVCache, which mlx-vlm's prefix cache matches by type.
_PinBatchRotatingKVCache = getattr(
    sys.modules[_PinRotatingKVCache.__module__], "BatchRotatingKVCache", None
)
BatchRotatingKVCache = (
    type(
        "BatchRotatingKVCache",
        (_KeepsRowDeltas, _PinBatchRotatingKVCache),
        {"__module__": __name__},
    )
    if _PinBatchRotatingKVCache is not None and hasattr(_PinRotatingKVCache, "merge")
    else None
)


class Issued:
    """Arrays the model handed out (or a host passes whole), recognised by identity, held weakly."""

    def __init__(self) -> None:
        self._entries: Dict[int, Tuple[weakref.ref, Dict[str, Any]]] = {}

    def mark(self, array: Any, **info: Any) -> None:
        key = id(array)

        def forget(ref: Any, key: int = key) -> None:
            if self._entries.get(key, (None,))[0] is ref:
                del self._entries[key]

        self._entries[key] = (weakref.ref(array, forget), info)

    def info(self, array: Any) -> Dict[str, Any]:
        entry = self._entries.get(id(array))
        return entry[1] if entry is not None and entry[0]() is array else {}

    def start(self, array: mx.array, columns: int) -> int:
        """Where this forward's tokens start in an array covering more than them: the columns
        since it was first seen (whole-prompt positions count from column 0)."""
        info = self.info(array)
        if "first_column" not in info:
            info = {**info, "first_column": 0 if info.get("whole") else columns}
            self.mark(array, **info)
        return columns - info["first_column"]


class Positions:
    """Where the tokens of one forward pass sit: a scalar or per-row offset, or [3, B, L] ids."""

    def __init__(self, offset: Any = 0, explicit: Optional[mx.array] = None):
        self.offset = offset
        self.explicit = explicit
        self._tables: Dict[int, Tuple[mx.array, mx.array]] = {}

    def cos_sin(self, rotary: Any) -> Tuple[mx.array, mx.array]:
        """``rotary``'s cos/sin of the explicit positions, computed once per forward."""
        if id(rotary) not in self._tables:
            self._tables[id(rotary)] = rotary.cos_sin(self.explicit)
        return self._tables[id(rotary)]


def resolve(
    lm: Any,
    cache: List[Any],
    B: int,
    L: int,
    position_ids: Any,
    rope_deltas: Any,
    deepstack: Any,
    kwargs: Dict,
) -> Tuple[Positions, Any]:
    """The positions of this forward by the table above, and ``deepstack`` cut to its tokens;
    keeps the delta its tokens use with the cache and in ``lm._rope_deltas``."""
    first = cache[0]
    batched = is_batch_cache(first)
    if (
        not batched
        and type(first) is _PinRotatingKVCache
        and BatchRotatingKVCache is not None
    ):
        # Rebuilt by a host as the pin's class (Rapid-MLX's restored prefix snapshot): the model's
        # subclass, same state, so a merge called on it keeps every row's delta.
        first.__class__ = lm.sliding_cache_class
    if batched:
        absorb_prompt_padding(
            cache, kwargs.get("attention_mask"), B, L, kwargs.get("prompt_padding")
        )
        # A copy: batch caches update ``offset`` in place in layer 0, and every later layer must
        # still rotate from where this chunk starts.
        offset, columns = (
            mx.array(first.offset),
            getattr(first, "_offset", getattr(first, "_idx", 0)),
        )
    else:
        offset = columns = first.offset if first is not None else 0
    fresh = columns == 0
    if fresh:
        lm._rope_deltas = None
    state = keep(first)
    if state is not None and fresh:
        state.delta, state.since = None, None
    if deepstack is not None and deepstack.shape[1] != L:
        start = lm.issued.start(deepstack, columns)
        deepstack = deepstack[:, start : start + L]

    # Set back by a host: the cache holds fewer tokens than it did (read only then: a decode
    # step never reads the device for it).
    set_back = not batched and state is not None and 0 < columns < state.reached
    if not batched and state is not None:
        refuse_a_ring_cut_after_it_wrapped(cache, state, columns, set_back)
        state.reached = columns + L
    if position_ids is not None:
        position_ids = unslice_positions(lm._position_ids, position_ids, B, L, columns)
        if not batched:
            refuse_positions_after_another_prefix(
                lm.issued, position_ids, lm._position_ids, columns
            )
        if position_ids.shape[-1] != L:
            start = lm.issued.start(position_ids, columns)
            position_ids = position_ids[..., start : start + L]
        if position_ids.ndim == 2:
            position_ids = mx.broadcast_to(
                position_ids[None], (3,) + tuple(position_ids.shape)
            )
        if position_ids.shape[1] != B:
            position_ids = fill_text_rows(
                position_ids, B, L, offset, rope_deltas, kwargs
            )

    given = lm.issued.info(rope_deltas) if rope_deltas is not None else {}
    if rope_deltas is not None and not isinstance(
        rope_deltas, (int, np.integer, mx.array)
    ):
        rope_deltas = mx.array(rope_deltas)
    holds = (
        state is not None
        and state.delta is not None
        and (not set_back or _holds(state, columns))
    )
    if given.get("text") and not fresh:
        # A text prompt's own zeros after a restored prefix (mlx-vlm 0.4.x merges them into its
        # kwargs): the suffix continues the cache's kept delta where it holds.
        rope_deltas = state.delta if holds else rope_deltas
    if position_ids is not None:
        # The delta decode steps continue from (per row): last position + 1 - tokens so far.
        # Lazy, so no host sync; a later chunk of the same prompt overwrites it.
        last = position_ids.max(axis=(0, 2))
        used = (
            (last + 1 - (offset + L)).reshape(-1, 1)
            if rope_deltas is None
            else rope_deltas
        )
        _keep(lm, state, used, None if batched else columns + L)
        if L > 1 and not batched and state is not None:
            # Prefill only: a decoded token follows the delta, and no lazy chain grows per step.
            state.since = _past_last_vision_token(position_ids, columns, L, state.since)
        return Positions(explicit=position_ids), deepstack

    if rope_deltas is None and not fresh:
        rope_deltas = _delta_for(lm, state, B, holds, None if batched else columns)
    used = (
        rope_deltas
        if rope_deltas is not None
        else (0 if B == 1 else mx.zeros((B, 1), mx.int32))
    )
    _keep(lm, state, used, None if batched else columns + L)
    return _offset_by(lm, offset, rope_deltas, B), deepstack


def _offset_by(lm: Any, offset: Any, delta: Any, B: int) -> Positions:
    if delta is None:
        return Positions(offset=offset)
    value = lm.issued.info(delta).get("value")
    if value is not None:  # one delta for every row, known without a device read
        delta = value
    if isinstance(delta, (int, np.integer)):
        return Positions(offset=offset + int(delta))
    rows = delta_rows(delta)
    if rows.size not in (1, B):
        raise ValueError(
            f"rope_deltas has {rows.size} rows but the batch has {B}; pass one delta per row"
        )
    # One offset per row: mx.fast.rope takes a [B] offset array.
    return Positions(offset=mx.broadcast_to(offset + rows, (B,)))


def _holds(state: Kept, columns: int) -> bool:
    since = state.since
    return (
        since is None
        or int(since.item() if isinstance(since, mx.array) else since) <= columns
    )


def _rows(delta: Any) -> int:
    return 1 if isinstance(delta, (int, np.integer)) else int(np.prod(delta.shape))


def _delta_for(
    lm: Any, state: Optional[Kept], B: int, holds: bool, columns: Any
) -> Optional[Any]:
    """The delta a continuing cache's tokens follow when none is given: none where the cache was
    set back before its kept delta holds (its text there follows the offset); else the kept one,
    or for a cache that kept none (a host rebuilt it) the module's, when its rows match and it is
    this request's (:func:`_module_delta_for`; ``columns`` None for a batch cache)."""
    if state is not None and state.delta is not None and not holds:
        return None
    for delta in (
        state.delta if state is not None else None,
        _module_delta_for(lm, columns),
    ):
        if delta is not None and _rows(delta) == B:
            return delta
    return None


def _module_delta_for(lm: Any, columns: Any) -> Optional[Any]:
    """``lm._rope_deltas`` for a cache that kept no delta: one a host installed (Rapid-MLX's media
    lane); for a batch cache (``columns`` None: a host merged request caches it rebuilt, right
    after their prefills) the last one we published. For a single-sequence cache at ``columns``,
    one we published only when the forward that published it ended there (a host rebuilt that
    request's cache): not another request's (Rapid-MLX restores a text prompt's prefix, saved
    by an earlier server, right after serving a picture)."""
    delta = lm._rope_deltas
    info = lm.issued.info(delta) if delta is not None else {}
    if delta is None or columns is None or "published_until" not in info:
        return delta
    until = info["published_until"]
    return (
        delta
        if until is not None
        and isinstance(columns, (int, np.integer))
        and int(columns) == until
        else None
    )


def _keep(lm: Any, state: Optional[Kept], delta: Any, until: Any) -> None:
    """Keep ``delta`` with the cache and publish it in ``lm._rope_deltas``, marked as ours with
    the column where this forward ended (``until``; None for a batch cache or an offset we do
    not read)."""
    # Kept as an mx.array on the module: mlx-vlm 0.6.x's batch generator reads and resets it.
    published = (
        mx.array([[int(delta)]]) if isinstance(delta, (int, np.integer)) else delta
    )
    lm._rope_deltas = published
    until = int(until) if isinstance(until, (int, np.integer)) else None
    lm.issued.mark(published, **{**lm.issued.info(published), "published_until": until})
    if state is not None:
        state.delta = delta


def _past_last_vision_token(
    position_ids: mx.array, columns: int, L: int, before: Any
) -> Any:
    """The column past this chunk's last token whose position does not follow the final delta
    (a vision token), else where the delta held before (this chunk's start if unknown). Lazy."""
    rows = position_ids.max(axis=0)  # [B, L]
    steps = rows - mx.arange(L)[None]  # constant over the tokens that follow one delta
    off = steps != steps[:, -1:]
    past_last_off = mx.max(mx.where(off, mx.arange(1, L + 1)[None], 0))
    return mx.where(
        past_last_off > 0,
        columns + past_last_off,
        columns if before is None else before,
    )


def is_batch_cache(c: Any) -> bool:
    """mlx-lm / mlx-vlm batch caches: left-padded rows whose ``offset`` is a per-row array."""
    return (
        c is not None
        and isinstance(getattr(c, "offset", None), mx.array)
        and c.offset.ndim == 1
    )


def refuse_a_ring_cut_after_it_wrapped(
    cache: List[Any], state: Kept, columns: int, set_back: bool
) -> None:
    """Refuse a sliding-window cache set back to ``columns`` tokens after it held more than its
    window: its ring then holds the last tokens, not the first ``columns`` (mlx-vlm 0.4.4's
    ``PromptCacheState`` slices every cache to the reused prefix), and the answer would be wrong."""
    ring = next((c for c in cache if c is not None and hasattr(c, "max_size")), None)
    if set_back and ring is not None and state.reached > ring.max_size:
        raise ValueError(
            f"The sliding-window cache was set back to {columns} tokens after it held {state.reached}, past "
            f"its window of {ring.max_size}: it no longer holds the first {columns} tokens (mlx-vlm 0.4.x's "
            "PromptCacheState trims caches by slicing). Start a new PromptCacheState (a new chat) for this "
            "turn, or keep the conversation within the model's sliding_window"
        )


def refuse_positions_after_another_prefix(
    issued: Issued, position_ids: mx.array, prompt: Any, columns: int
) -> None:
    """Refuse positions from ``get_input_embeddings`` that do not follow the tokens the cache
    holds: a prompt's own positions (they count from its first token) on a cache that holds
    other tokens, or a suffix's positions placed after a prefix of another length."""
    info = issued.info(position_ids)
    if info.get("whole") or "first_column" in info or position_ids is not prompt:
        return  # whole-prompt positions, or a prompt's array passed again with a later chunk
    prefix = info.get("prefix", 0)
    if columns == prefix:
        return
    if prefix:
        raise ValueError(
            f"position_ids follow a cached prefix of {prefix} tokens (the whole prompt's mm_token_type_ids "
            f"were passed with its last tokens), but the cache holds {columns} tokens: pass the cache "
            "restored to exactly the tokens before input_ids"
        )
    raise ValueError(
        f"position_ids count from this prompt's first token, but the cache already holds {columns} "
        "tokens: the prompt was cut after a restored prefix cache and a picture or video follows the "
        "cut. Pass the whole prompt's mm_token_type_ids, image_grid_thw and pixels (as mlx-vlm 0.4.4's "
        "PromptCacheState does) so the model can place the rest, or start a new prompt cache"
    )


def unslice_positions(
    prompt: Any, position_ids: mx.array, B: int, L: int, columns: int
) -> mx.array:
    """``[3, B, L]`` positions back from a batch host that cut their first axis as a batch axis
    (mlx-vlm 0.4.4: ``[min(3, B), B, L]``; 0.6.3: ``[B, B, L]``, the temporal axis B times): the
    prompt's own array (``_position_ids``) where its temporal axis is the one given; another
    wrong-shaped array is refused."""
    if position_ids.ndim != 3 or (position_ids.shape[0] == 3 and (B != 3 or L == 1)):
        return position_ids  # decode steps never need the (host-reading) check below
    if (
        prompt is not None
        and prompt is not position_ids
        and prompt.ndim == 3
        and prompt.shape[:2] == (3, position_ids.shape[1])
    ):
        window = prompt
        if position_ids.shape[-1] != prompt.shape[-1]:  # a host's per-chunk slice
            window = prompt[..., columns : columns + position_ids.shape[-1]]
        if window.shape[-1] == position_ids.shape[-1]:
            if position_ids.shape[0] != 3:
                if mx.array_equal(position_ids[0], window[0]).item():
                    return window
            else:  # B = 3: only the temporal axis three times over (0.6.3), where the axes differ
                temporal = mx.broadcast_to(window[:1], window.shape)
                if (
                    mx.array_equal(position_ids, temporal).item()
                    and not mx.array_equal(window, temporal).item()
                ):
                    return window
    if position_ids.shape[0] == 3:
        return position_ids
    raise ValueError(
        f"position_ids has shape {tuple(position_ids.shape)}, but MRoPE positions are [3, batch, length] "
        f"(this batch: {B} rows of {L} tokens); pass the [3, B, L] array get_input_embeddings returned, "
        "sliced on its last axis only"
    )


def fill_text_rows(
    position_ids: mx.array, B: int, L: int, offset: Any, deltas: Any, kwargs: Dict
) -> mx.array:
    """``[3, B, L]`` positions from a batch whose picture rows alone brought them (mlx-vlm 0.6+
    joins each key over the rows that carry it): which rows, from ``position_rows`` (every row
    carries it, uncut per chunk), else ``visual_pos_masks``; text rows take offset + own delta."""
    flags, visual = kwargs.get("position_rows"), kwargs.get("visual_pos_masks")
    if flags is not None and int(np.size(flags)) == B:
        rows = np.nonzero(np.array(flags).reshape(-1))[0]
    elif visual is not None:
        rows = np.nonzero(np.array(visual).reshape(B, -1).any(axis=1))[0]
    else:
        raise ValueError(
            f"position_ids has {position_ids.shape[1]} rows but the batch has {B}; pass one row per "
            "sequence (or the position_rows get_input_embeddings returned, to tell which rows they are)"
        )
    if len(rows) != position_ids.shape[1]:
        raise ValueError(
            f"position_ids has {position_ids.shape[1]} rows but {len(rows)} of the batch's {B} rows are "
            "marked as having positions; pass one row per sequence"
        )
    start = mx.array(offset).reshape(-1, 1)
    if deltas is not None and int(np.size(deltas)) == B:
        start = start + delta_rows(deltas).reshape(-1, 1).astype(start.dtype)
    text = mx.broadcast_to(start + mx.arange(L), (B, L)).astype(position_ids.dtype)
    full = mx.array(mx.broadcast_to(text[None], (3, B, L)))
    full[:, mx.array(rows.astype(np.uint32))] = position_ids
    return full


def absorb_prompt_padding(
    cache: List[Any], attention_mask: Any, B: int, L: int, prompt_padding: Any
) -> None:
    """Declare to empty batch caches the left padding only the prompt's arrays show (mlx-vlm
    0.4.x-0.6.x ``batch_generate`` hands padded rows over as real tokens: unmasked, rows attend to
    it and decode positions run ahead), as mlx-lm's ``prepare(left_padding=)``: from
    ``prompt_padding`` (whole however the prefill is cut), else this chunk's ``attention_mask``;
    padding the caches already know (mlx-vlm 0.7) is not added twice."""
    first = cache[0]
    if getattr(first, "keys", None) is not None or not hasattr(first, "left_padding"):
        return  # padding can only be declared before the first tokens go in
    if prompt_padding is not None and int(np.size(prompt_padding)) == B:
        lead = np.asarray(prompt_padding).reshape(-1)
    elif getattr(attention_mask, "ndim", 0) == 2 and tuple(attention_mask.shape) == (
        B,
        L,
    ):
        keep_mask = np.asarray(attention_mask).astype(bool)
        lead = np.where(keep_mask.any(axis=1), keep_mask.argmax(axis=1), L)
    else:
        return
    extra = np.maximum(lead - np.asarray(first.left_padding).reshape(-1), 0)
    if not extra.any():
        return
    for c in cache:
        if hasattr(c, "prepare"):
            c.prepare(left_padding=extra.tolist())
        else:  # older mlx-lm batch caches: what prepare() does
            c.left_padding = c.left_padding + mx.array(extra)
            c.offset = c.offset - mx.array(extra)


def whole_prompt_positions(
    lm: Any, input_ids: Any, image_grid_thw: Any, video_grid_thw: Any, mask: Any
):
    """``lm.get_rope_index``: a whole prompt's positions ``[3, B, L]`` (marked as counting from
    column 0) and deltas ``[B, 1]``."""
    for grid, token, name in (
        (image_grid_thw, lm.image_token_id, "image_token_id"),
        (video_grid_thw, lm.video_token_id, "video_token_id"),
    ):
        if grid is not None and token is None:
            raise ValueError(
                f"get_rope_index needs {name}: build LanguageModel through Model"
            )
    position_ids, deltas = get_rope_index(
        np.array(input_ids),
        image_grid_thw,
        -1 if lm.image_token_id is None else lm.image_token_id,
        lm.spatial_merge_size,
        attention_mask=padding_rows(mask),
        video_grid_thw=video_grid_thw,
        video_token_id=lm.video_token_id,
    )
    positions = mx.array(position_ids)
    lm.issued.mark(positions, whole=True)
    return positions, mx.array(deltas.reshape(-1, 1))


def padding_rows(mask: Any) -> Optional[np.ndarray]:
    """A 2-D ``[B, L]`` attention mask as numpy (1 = token, 0 = padding), else None."""
    return (
        np.array(mask) if mask is not None and getattr(mask, "ndim", 0) == 2 else None
    )


_NAMES = {
    IMAGE: ("image", "image", "image_grid_thw", "image(s)"),
    VIDEO: (
        "video",
        "video (one block per temporal patch)",
        "video_grid_thw",
        "temporal patch(es)",
    ),
}


def get_rope_index(
    input_ids: np.ndarray,
    image_grid_thw,
    image_token_id: int,
    spatial_merge_size: int,
    attention_mask: Optional[np.ndarray] = None,
    mm_token_type_ids: Optional[np.ndarray] = None,
    video_grid_thw=None,
    video_token_id: Optional[int] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """Qwen-VL position ids [3, B, L] and rope deltas [B]: a run of vision tokens takes its merged
    grid's (t, h, w) indices plus the running position, and the text after it starts at the
    running position + max(h, w) / merge; each temporal patch of a video is a run with t = 1.
    Types from ``mm_token_type_ids`` (0 text, 1 image, 2 video), else the ids; padding gets 0."""
    input_ids = np.asarray(input_ids)
    B, L = input_ids.shape
    if mm_token_type_ids is not None:
        types = np.asarray(mm_token_type_ids)
    else:
        types = (input_ids == image_token_id).astype(np.int32)
        if video_token_id is not None:
            types[input_ids == video_token_id] = VIDEO
    videos = list(grid_sequence(video_grid_thw)) if video_grid_thw is not None else []
    runs = {
        IMAGE: list(grid_sequence(image_grid_thw))
        if image_grid_thw is not None
        else [],
        VIDEO: [(1, h, w) for t, h, w in videos for _ in range(t)],
    }
    taken = {IMAGE: 0, VIDEO: 0}
    m = spatial_merge_size
    position_ids = np.zeros((3, B, L), dtype=np.int32)
    deltas = np.zeros((B,), dtype=np.int64)
    for b in range(B):
        keep_mask = (
            np.asarray(attention_mask[b]).astype(bool)
            if attention_mask is not None
            else np.ones(L, bool)
        )
        row_types = types[b][keep_mask]
        pieces: List[np.ndarray] = []
        pos, i, n = 0, 0, len(row_types)
        while i < n:
            kind = int(row_types[i])
            if kind == 0:
                j = i
                while j < n and row_types[j] == 0:
                    j += 1
                pieces.append(np.broadcast_to(np.arange(pos, pos + j - i), (3, j - i)))
                pos, i = pos + j - i, j
                continue
            name, item, grids_name, unit = _NAMES[kind]
            if taken[kind] >= len(runs[kind]):
                raise ValueError(
                    f"The prompt has more {name} tokens than {grids_name} describes ({len(runs[kind])} "
                    f"{unit}); pass one grid row per {name}"
                )
            t, h, w = runs[kind][taken[kind]]
            taken[kind] += 1
            gh, gw = h // m, w // m
            count = t * gh * gw
            run = row_types[i : i + count]
            if len(run) != count or not np.all(run == kind):
                raise ValueError(
                    f"{name.capitalize()} run {taken[kind] - 1} needs {count} tokens for grid "
                    f"({t}, {h}, {w}) but the prompt has a run of {int(np.sum(run == kind))}"
                )
            tt, hh, ww = np.meshgrid(
                np.arange(t), np.arange(gh), np.arange(gw), indexing="ij"
            )
            pieces.append(np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + pos)
            pos, i = pos + max(gh, gw), i + count
        row = np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), np.int32)
        position_ids[:, b, keep_mask] = row
        deltas[b] = (int(row.max()) + 1 - n) if n else 0
    for kind, grids in runs.items():
        if taken[kind] < len(grids):
            name, item, grids_name, unit = _NAMES[kind]
            raise ValueError(
                f"{grids_name} describes {len(grids)} {unit} but the prompt has {name} tokens for fewer; "
                f"each {item} needs its own placeholder"
            )
    return position_ids, deltas
