"""Where a request's MRoPE positions come from: the one module that writes position state.

Positions are ``[3, B, L]`` (t, h, w). Terms:

- **column**: where this forward's tokens start in the request's cache, i.e. how many tokens
  (left padding included) it already holds: ``cache.offset`` for one sequence, the write index
  (``_offset`` / ``_idx``) of a batch cache.
- **offset**: the position this forward's first token takes as plain text: the column for one
  sequence; per row, the column less that row's left padding (a batch cache's ``offset``).
- **delta**: what a row's text adds to its offset: 0 until a picture or video patch, whose tokens
  take the indices of its merged grid (:func:`get_rope_index`); the text after it continues at
  ``offset + delta``, ``delta = last position + 1 - tokens`` (negative).

The state, written only here:

- :class:`Kept` on the request's first cache layer: the delta (per row), the column from which
  it holds and the most tokens the cache held; batch caches made by ``merge`` carry each row's.
- a :class:`Mark` per array the model handed out (or a host passed whole), in ``lm.issued``.
- ``_rope_deltas`` / ``_position_ids`` on the language model, for hosts that read them after a
  prefill, as on Qwen-VL models in mlx-vlm.

:func:`resolve` first repairs what hosts hand over: a first layer rebuilt as the pin's rotating
class; a batch's left padding only the prompt's arrays show; positions whose first axis a host cut
as a batch axis; arrays passed whole with every chunk; a batch's positions only its picture rows
brought (text rows get offset + own delta). Then it reads the request and takes the cell:

One sequence:

| request \\ given | positions | a caller's deltas | our text zeros | nothing |
| --- | --- | --- | --- | --- |
| new (column 0) | those | offset + delta | offset | offset |
| continuing its cache | those; refused if they count from another column | offset + delta | offset + kept delta if it holds | offset + kept delta if it holds |
| set back by a host, before the kept delta holds | those | offset + delta | offset | offset |
| built by a host (nothing kept) | those | offset + delta | offset | offset + ``_rope_deltas`` if it is this request's (a host installed it, or the forward that published it ended at this column) |

A batch (per-row offsets):

| request \\ given | positions | a caller's deltas | our text zeros | nothing |
| --- | --- | --- | --- | --- |
| new | those, text rows filled | offset + delta per row | offset | offset |
| continuing | those, text rows filled | offset + delta per row | offset + kept deltas | offset + kept deltas, else the ``_rope_deltas`` a host merged with |

Then it writes once the delta the tokens used (after explicit positions, ``last position + 1 -
tokens`` per row). A rotating cache set back after its ring wrapped is refused.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, replace
from typing import Any, Dict, Generic, List, Optional, Tuple, TypeVar

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
    return getattr(first, KEPT, None)


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
    return delta_rows(getattr(kept(cache), "delta", None))


def _keep_rows(cache: Any, rows: Any) -> None:
    setattr(cache, KEPT, Kept(delta=rows))


class _KeepsRowDeltas:
    """A batch cache made by ``merge`` of this model's request caches: each row's delta stays with
    its row through ``filter``, ``extend`` and ``extract`` (Rapid-MLX prefills requests one by one,
    merges their caches and decodes with nothing but the cache)."""

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
                # Same state; keeps merge (and to_quantized) ours.
                single.__class__ = self.request_class
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


T = TypeVar("T")


class Issued(Generic[T]):
    """A weak identity map (arrays are not hashable by value): arrays the model handed out, or a
    host passes whole, each with what is known of it."""

    def __init__(self) -> None:
        self._entries: Dict[int, Tuple[weakref.ref, T]] = {}

    def mark(self, array: Any, value: T) -> None:
        key = id(array)

        def forget(ref: Any, key: int = key) -> None:
            if self._entries.get(key, (None,))[0] is ref:
                del self._entries[key]

        self._entries[key] = (weakref.ref(array, forget), value)

    def get(self, array: Any) -> Optional[T]:
        entry = self._entries.get(id(array))
        return entry[1] if entry is not None and entry[0]() is array else None


@dataclass(frozen=True)
class Mark:
    """What the model knows of an array it handed out, or a host passed whole."""

    whole: bool = False  # a whole prompt's positions: they count from column 0
    prefix: int = 0  # a suffix's positions: they follow this many cached tokens
    value: Optional[int] = None  # a delta's one value, when every row has it
    text: bool = False  # a text prompt's zero deltas
    published: bool = False  # a delta published in ``_rope_deltas``...
    until: Optional[int] = None  # ...by a forward ending at this column (None: batch)
    first_column: Optional[int] = None  # where a host first passed it with a chunk


def marked(lm: Any, array: Any) -> Mark:
    mark = lm.issued.get(array) if array is not None else None
    return Mark() if mark is None else mark


def publish_prompt(
    lm: Any, position_ids: mx.array, deltas: Any, prefix: int
) -> mx.array:
    """A prompt's positions (following ``prefix`` cached tokens) and deltas, marked and set on
    the language model, where hosts read them; returns the deltas ``[B, 1]``."""
    rope_deltas = mx.array(np.asarray(deltas).reshape(-1, 1))
    values = set(np.asarray(deltas).reshape(-1).tolist())
    lm.issued.mark(rope_deltas, Mark(value=values.pop() if len(values) == 1 else None))
    lm.issued.mark(position_ids, Mark(prefix=prefix))
    lm._position_ids, lm._rope_deltas = position_ids, rope_deltas
    return rope_deltas


def text_zeros(lm: Any, B: int) -> mx.array:
    """A text prompt's deltas: zeros, marked so a restored prefix's kept delta wins over them."""
    zeros = mx.zeros((B, 1), dtype=mx.int64)
    lm.issued.mark(zeros, Mark(value=0, text=True))
    return zeros


class Positions:
    """Where the tokens of one forward sit: a scalar or per-row offset, or [3, B, L] ids;
    ``column`` is where they start in the cache."""

    def __init__(self, offset: Any = 0, explicit: Optional[mx.array] = None, column=0):
        self.offset = offset
        self.explicit = explicit
        self.column = column
        self._tables: Dict[int, Tuple[mx.array, mx.array]] = {}

    def cos_sin(self, rotary: Any) -> Tuple[mx.array, mx.array]:
        """``rotary``'s cos/sin of the explicit positions, computed once per forward."""
        if id(rotary) not in self._tables:
            self._tables[id(rotary)] = rotary.cos_sin(self.explicit)
        return self._tables[id(rotary)]


def chunk_of(lm: Any, array: Any, column: int, L: int) -> Any:
    """This forward's ``L`` tokens of an array covering more (a host passes a whole prompt's
    positions or deepstack with every chunk), counted from the column it was first seen at."""
    # Deepstack is [B, L, K, D]; positions [3, B, L] or [B, L].
    tokens = 1 if array is not None and array.ndim == 4 else -1
    if array is None or array.shape[tokens] == L:
        return array
    mark = marked(lm, array)
    first = mark.first_column
    if first is None:
        first = 0 if mark.whole else column
        lm.issued.mark(array, replace(mark, first_column=first))
    start = column - first
    return array[:, start : start + L] if tokens == 1 else array[..., start : start + L]


@dataclass
class _Request:
    """What :func:`resolve` reads of a request before it takes the table's cell."""

    batched: bool
    offset: Any  # an int, or per row (a copy: batch caches move theirs in place)
    column: int
    kept: Kept  # the cache's; empty where it kept nothing
    set_back: bool  # a host cut the cache below what it held (one sequence)
    holds: bool  # the kept delta holds at this column

    @property
    def fresh(self) -> bool:
        return self.column == 0


def _repair(lm: Any, cache: List[Any], B: int, L: int, kwargs: Dict) -> None:
    first = cache[0]
    if is_batch_cache(first):
        absorb_prompt_padding(
            cache, kwargs.get("attention_mask"), B, L, kwargs.get("prompt_padding")
        )
    elif type(first) is _PinRotatingKVCache and BatchRotatingKVCache is not None:
        # Rebuilt by a host as the pin's class (Rapid-MLX's restored prefix snapshot): the model's
        # subclass, same state, so a merge called on it keeps every row's delta.
        first.__class__ = lm.sliding_cache_class


def _read(cache: List[Any]) -> _Request:
    first = cache[0]
    batched = is_batch_cache(first)
    if batched:
        offset = mx.array(first.offset)
        column = getattr(first, "_offset", getattr(first, "_idx", 0))
    else:
        offset = column = first.offset if first is not None else 0
    state = Kept() if column == 0 else (kept(first) or Kept())
    set_back = not batched and 0 < column < state.reached
    since = state.since
    holds = state.delta is not None and (
        not set_back
        or since is None
        or int(since.item() if isinstance(since, mx.array) else since) <= column
    )
    return _Request(batched, offset, column, state, set_back, holds)


def resolve(
    lm: Any,
    cache: List[Any],
    B: int,
    L: int,
    position_ids: Any,
    rope_deltas: Any,
    kwargs: Dict,
) -> Positions:
    """The positions of this forward, by the table above."""
    _repair(lm, cache, B, L, kwargs)
    request = _read(cache)
    refuse_a_ring_cut_after_it_wrapped(cache, request)
    explicit = (
        None
        if position_ids is None
        else _explicit(lm, request, position_ids, rope_deltas, B, L, kwargs)
    )
    delta = _given_delta(lm, request, rope_deltas)
    since = request.kept.since
    if explicit is not None:
        # Lazy (no host sync); a later chunk of the same prompt overwrites it.
        last = explicit.max(axis=(0, 2))
        used = (
            (last + 1 - (request.offset + L)).reshape(-1, 1) if delta is None else delta
        )
        if L > 1 and not request.batched:
            # Prefill only: a decoded token follows the delta, and no lazy chain grows per step.
            since = _past_last_vision_token(explicit, request.column, L, since)
        positions = Positions(explicit=explicit)
    else:
        if delta is None and not request.fresh:
            delta = _delta_for(lm, request, B)
        used = (
            delta
            if delta is not None
            else (0 if B == 1 else mx.zeros((B, 1), mx.int32))
        )
        positions = _offset_by(lm, request.offset, delta, B)
    _write(lm, cache, request, used, since, L)
    positions.column = request.column
    return positions


def _explicit(
    lm: Any, request: _Request, position_ids: Any, deltas: Any, B: int, L: int, kwargs
) -> mx.array:
    """Given positions as ``[3, B, L]`` for this chunk."""
    column = request.column
    position_ids = unslice_positions(lm._position_ids, position_ids, B, L, column)
    if not request.batched:
        refuse_positions_after_another_prefix(lm, position_ids, column)
    position_ids = chunk_of(lm, position_ids, column, L)
    if position_ids.ndim == 2:
        position_ids = mx.broadcast_to(
            position_ids[None], (3,) + tuple(position_ids.shape)
        )
    if position_ids.shape[1] != B:
        position_ids = fill_text_rows(
            position_ids, B, L, request.offset, deltas, kwargs
        )
    return position_ids


def _given_delta(lm: Any, request: _Request, given: Any) -> Any:
    """The caller's delta; our text zeros give way to a kept delta that holds (mlx-vlm 0.4.x
    merges a text prompt's zeros into its kwargs after a restored prefix)."""
    if given is not None and not isinstance(given, (int, np.integer, mx.array)):
        given = mx.array(given)
    if given is not None and marked(lm, given).text and not request.fresh:
        return request.kept.delta if request.holds else given
    return given


def _write(
    lm: Any, cache: List[Any], request: _Request, used: Any, since: Any, L: int
) -> None:
    """Keep ``used`` with the cache and publish it in ``lm._rope_deltas``."""
    # An mx.array on the module: mlx-vlm 0.6.x's batch generator reads and resets it.
    published = mx.array([[int(used)]]) if isinstance(used, (int, np.integer)) else used
    column = request.column
    single = not request.batched and isinstance(column, (int, np.integer))
    until = int(column) + L if single else None
    lm._rope_deltas = published
    lm.issued.mark(
        published, replace(marked(lm, published), published=True, until=until)
    )
    first = cache[0]
    if first is None:
        return
    state = kept(first)
    if state is None:
        setattr(first, KEPT, state := Kept())
    state.delta = used
    state.since = since
    if not request.batched:
        state.reached = request.column + L


def _offset_by(lm: Any, offset: Any, delta: Any, B: int) -> Positions:
    if delta is None:
        return Positions(offset=offset)
    value = marked(lm, delta).value
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


def _delta_for(lm: Any, request: _Request, B: int) -> Optional[Any]:
    """A continuing cache's delta when none is given: the kept one where it holds, else for a
    cache that kept none the module's, when it has a row per sequence and is this request's."""
    kept_delta = request.kept.delta
    if kept_delta is not None and not request.holds:
        return None
    column = None if request.batched else request.column
    for delta in (kept_delta, _module_delta_for(lm, column)):
        if delta is not None and delta_rows(delta).size == B:
            return delta
    return None


def _module_delta_for(lm: Any, column: Any) -> Optional[Any]:
    """``lm._rope_deltas`` unless we published it for another request: for a single-sequence
    cache at ``column`` (not None), one we published only if the forward that published it ended
    there (Rapid-MLX restores a text prompt's prefix right after serving a picture)."""
    delta = lm._rope_deltas
    mark = marked(lm, delta)
    if delta is None or column is None or not mark.published:
        return delta
    return (
        delta
        if mark.until is not None
        and isinstance(column, (int, np.integer))
        and int(column) == mark.until
        else None
    )


def _past_last_vision_token(
    position_ids: mx.array, column: int, L: int, before: Any
) -> Any:
    """The column past this chunk's last token whose position does not follow the final delta
    (a vision token), else ``before`` (this chunk's start if None). Lazy."""
    rows = position_ids.max(axis=0)  # [B, L]
    steps = rows - mx.arange(L)[None]  # constant over the tokens that follow one delta
    off = steps != steps[:, -1:]
    past_last_off = mx.max(mx.where(off, mx.arange(1, L + 1)[None], 0))
    return mx.where(
        past_last_off > 0,
        column + past_last_off,
        column if before is None else before,
    )


def is_batch_cache(c: Any) -> bool:
    """mlx-lm / mlx-vlm batch caches: left-padded rows whose ``offset`` is a per-row array."""
    return (
        c is not None
        and isinstance(getattr(c, "offset", None), mx.array)
        and c.offset.ndim == 1
    )


def refuse_a_ring_cut_after_it_wrapped(cache: List[Any], request: Any) -> None:
    """Refuse a sliding-window cache set back after it held more than its window: its ring
    holds the last tokens, not the first ones (mlx-vlm 0.4.4's ``PromptCacheState``)."""
    ring = next((c for c in cache if c is not None and hasattr(c, "max_size")), None)
    columns, state = request.column, request.kept
    if request.set_back and ring is not None and state.reached > ring.max_size:
        raise ValueError(
            f"The sliding-window cache was set back to {columns} tokens after it held {state.reached}, past "
            f"its window of {ring.max_size}: it no longer holds the first {columns} tokens (mlx-vlm 0.4.x's "
            "PromptCacheState trims caches by slicing). Start a new PromptCacheState (a new chat) for this "
            "turn, or keep the conversation within the model's sliding_window"
        )


def refuse_positions_after_another_prefix(
    lm: Any, position_ids: mx.array, columns: int
) -> None:
    """Refuse positions from ``get_input_embeddings`` that do not follow the tokens the cache
    holds (a prompt's own on a cache holding others, a suffix's after another prefix)."""
    mark = marked(lm, position_ids)
    if (
        mark.whole
        or mark.first_column is not None
        or position_ids is not lm._position_ids
    ):
        return  # whole-prompt positions, or a prompt's array passed again with a later chunk
    prefix = mark.prefix
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
    (mlx-vlm 0.4.4: ``[min(3, B), B, L]``; 0.6.3: ``[B, B, L]``, the temporal axis B times)."""
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
    joins each key over the rows that carry it); text rows take offset + own delta."""
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
    0.4.x-0.6.x ``batch_generate`` hands padded rows over as real tokens)."""
    first = cache[0]
    if getattr(first, "keys", None) is not None or not hasattr(first, "left_padding"):
        return  # padding can only be declared before the first tokens go in
    if prompt_padding is not None and int(np.size(prompt_padding)) == B:
        lead = np.asarray(prompt_padding).reshape(-1)
    elif getattr(attention_mask, "ndim", 0) == 2 and tuple(attention_mask.shape) == (
        B,
        L,
    ):
        lead = leading_padding(np.asarray(attention_mask))
    else:
        return
    extra = np.maximum(lead - np.asarray(first.left_padding).reshape(-1), 0)
    if not extra.any():
        return
    for c in cache:
        c.prepare(left_padding=extra.tolist())


def whole_prompt_positions(
    lm: Any, input_ids: Any, image_grid_thw: Any, video_grid_thw: Any, mask: Any
):
    """``lm.get_rope_index``: a whole prompt's positions ``[3, B, L]`` and deltas ``[B, 1]``."""
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
    lm.issued.mark(positions, Mark(whole=True))
    return positions, mx.array(deltas.reshape(-1, 1))


def padding_rows(mask: Any) -> Optional[np.ndarray]:
    """A 2-D ``[B, L]`` attention mask as numpy (1 = token, 0 = padding), else None."""
    return (
        np.array(mask) if mask is not None and getattr(mask, "ndim", 0) == 2 else None
    )


def leading_padding(mask: np.ndarray) -> np.ndarray:
    """Per row of a 2-D mask, the padding before its first token (all of a row with none)."""
    mask = mask.astype(bool)
    return np.where(mask.any(axis=1), mask.argmax(axis=1), mask.shape[1])


def token_types(input_ids: Any, types: Any, image_token_id: int, video_token_id: Any):
    """``mm_token_type_ids`` as numpy, else 1 on image and 2 on video tokens (0 text)."""
    if types is not None:
        return np.array(types)
    ids = np.asarray(input_ids)
    types = (ids == image_token_id).astype(np.int32)
    if video_token_id is not None:
        types[ids == video_token_id] = VIDEO
    return types


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
    grid's (t, h, w) indices plus the running position, the text after it starts at the running
    position + max(h, w) / merge; each temporal patch of a video is a run. Padding gets 0."""
    B, L = np.shape(input_ids)
    types = token_types(input_ids, mm_token_type_ids, image_token_id, video_token_id)
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
