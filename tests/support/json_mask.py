"""Small logits processors that constrain decoding to JSON, for the structured-output tests.

mlx-vlm's ``generate_step`` calls each processor as ``processor(tokens, logits)``: ``tokens`` the
1-D context (the prompt, or its last prefill chunk, then each sampled id), ``logits`` [1, vocab].
Every processor here records its calls, so tests/test_structured_output.py can check that convention
as well as the answer.
Token ids are mapped to text by ``pieces`` (id -> its text, None for ids a JSON answer never uses:
special tokens, padded rows past the tokenizer).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

# A schema whose documents can be listed: two required keys, an enum and a bounded integer.
SCHEMA: Dict = {
    "type": "object",
    "properties": {
        "shape": {"type": "string", "enum": ["circle", "square", "triangle"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["shape", "count"],
    "additionalProperties": False,
}


# The fixed document a processor allows, id by id.
FIXED = '{"shape": "square", "count": 2}'

# A document whose first token is a real choice: one digit.
DIGIT_SCHEMA: Dict = {"type": "integer", "minimum": 0, "maximum": 9}


def _values(name: str, spec: Dict) -> list:
    if "enum" in spec:
        return list(spec["enum"])
    if spec.get("type") == "integer":
        return list(range(spec["minimum"], spec["maximum"] + 1))
    raise ValueError(f"cannot list the values of {name}: {spec}")


def documents(schema: Dict = SCHEMA) -> List[str]:
    """Every document of ``schema`` as ``json.dumps`` writes it (an object's keys in the schema's
    order). Only the shapes used here are understood: objects of string enums and bounded
    integers, or one such value."""
    if schema.get("type") != "object":
        return [json.dumps(v) for v in _values("the document", schema)]
    names = list(schema["properties"])
    values = [_values(name, schema["properties"][name]) for name in names]
    return [json.dumps(dict(zip(names, combo))) for combo in itertools.product(*values)]


def matches(schema: Dict, value) -> bool:
    """Whether ``value`` (parsed JSON) satisfies ``schema`` (the subset SCHEMA uses)."""
    if schema.get("type") == "object":
        if not isinstance(value, dict) or not set(schema.get("required", ())) <= set(value):
            return False
        if schema.get("additionalProperties") is False and not set(value) <= set(schema["properties"]):
            return False
        return all(matches(schema["properties"][k], v) for k, v in value.items() if k in schema["properties"])
    if "enum" in schema and value not in schema["enum"]:
        return False
    if schema.get("type") == "string":
        return isinstance(value, str)
    if schema.get("type") == "integer":
        # bool is an int in Python, never in JSON
        ok = isinstance(value, int) and not isinstance(value, bool)
        return ok and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    return True


def tokenizer_pieces(tokenizer, vocab_size: int) -> List[Optional[str]]:
    """id -> text for a Hugging Face tokenizer, over the model's ``vocab_size`` logits (which may
    be wider than the tokenizer: those ids, and special or added tokens, get None)."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    pieces: List[Optional[str]] = []
    for i in range(vocab_size):
        if i >= len(tokenizer) or i in special:
            pieces.append(None)
        else:
            pieces.append(tokenizer.decode([i], clean_up_tokenization_spaces=False) or None)
    return pieces


@dataclass
class Call:
    context: List[int]
    tokens_shape: tuple
    logits_shape: tuple
    allowed: Optional[List[int]]


def _masked(logits: mx.array, allowed: Sequence[int]) -> mx.array:
    keep = np.zeros(logits.shape[-1], dtype=bool)
    keep[list(allowed)] = True
    return mx.where(mx.array(keep), logits, mx.array(float("-inf"), dtype=logits.dtype))


class Recorder:
    """A processor that records each call; subclasses say which ids the next token may take."""

    def __init__(self) -> None:
        self.calls: List[Call] = []

    def allowed(self, generated: List[int]) -> Optional[List[int]]:
        """Ids the next token may take after ``generated``; None leaves the logits alone."""
        return None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        context = np.array(tokens).reshape(-1).tolist()
        step = len(self.calls)  # call k comes after k sampled ids: the context's last k
        generated = context[len(context) - step :] if step else []
        allowed = self.allowed(generated)
        self.calls.append(Call(context, tuple(tokens.shape), tuple(logits.shape), allowed))
        return logits if allowed is None else _masked(logits, allowed)


class Identity(Recorder):
    """Changes nothing: decoding must be exactly as without it."""


class FixedIds(Recorder):
    """Allows only the next id of ``target``, then only the end-of-sequence ids."""

    def __init__(self, target: Sequence[int], eos_ids: Sequence[int]) -> None:
        super().__init__()
        self.target, self.eos_ids = list(target), list(eos_ids)

    def allowed(self, generated: List[int]) -> List[int]:
        n = len(generated)
        return [self.target[n]] if n < len(self.target) else self.eos_ids


class ChoiceMask(Recorder):
    """Allows the ids whose text keeps the answer a prefix of one of ``docs`` (a schema's listed
    documents), and the end-of-sequence ids once the answer is a whole document."""

    def __init__(self, docs: Sequence[str], pieces: Sequence[Optional[str]], eos_ids: Sequence[int]) -> None:
        super().__init__()
        self.docs, self.pieces, self.eos_ids = list(docs), list(pieces), list(eos_ids)

    def allowed(self, generated: List[int]) -> Optional[List[int]]:
        if generated and generated[-1] in self.eos_ids:
            return None  # the pin's look-ahead past the end: nothing left to constrain
        if any(self.pieces[i] is None for i in generated):
            raise AssertionError(f"an id outside the mask was sampled: {generated}")
        text = "".join(self.pieces[i] for i in generated)
        ids = [i for i, p in enumerate(self.pieces) if p and any(d.startswith(text + p) for d in self.docs)]
        if text in self.docs:
            ids += self.eos_ids
        if not ids:
            raise AssertionError(f"{text!r} is a prefix of no document")
        return ids


def check_calls(
    recorder: Recorder, prompt_ids: Sequence[int], generated: Sequence[int], vocab_size: int, eos_ids: Sequence[int]
) -> None:
    """The pin's calling convention, as its ``generate_step`` is written: the first call sees the
    prompt's tail (the whole prompt on mlx-vlm 0.4-0.6; on 0.7 only its last id, the rest being
    prefilled before), call k that tail and the first k sampled ids, logits [1, vocab]; one call
    per sampled id, the last being the look-ahead (the pin computes step n+1 before it hands out
    id n). ``generated`` are the ids the caller got: the sampled ones, less an end-of-sequence id
    the pin may stop at without handing it out."""
    calls, prompt, generated = recorder.calls, list(prompt_ids), list(generated)
    assert calls, "the processor was never called"
    tail = calls[0].context
    assert 1 <= len(tail) <= len(prompt) and prompt[len(prompt) - len(tail) :] == tail, (tail, prompt)
    sampled = calls[-1].context[len(tail) :]
    assert len(calls) == len(sampled) + 1, (len(calls), len(sampled))
    for k, call in enumerate(calls):
        assert call.context == tail + sampled[:k], k
        assert call.tokens_shape == (len(tail) + k,), k
        assert call.logits_shape == (1, vocab_size), k
        if call.allowed is not None and k < len(sampled):
            assert sampled[k] in call.allowed, (k, sampled[k])
    assert sampled[: len(generated)] == generated, (sampled, generated)
    extra = sampled[len(generated) :]
    assert len(extra) <= 1 and all(i in eos_ids for i in extra), (sampled, generated)


# --------------------------------------------------------------------------- the pin's mask on a CPU
def cpu_bitmask(logits: mx.array, mask) -> mx.array:
    """llguidance's packed mask applied without Metal: bit (id % 32) of word (id // 32) allows id;
    ids past the mask's words (padded logits rows) are disallowed, as the pin's kernel does."""
    rows = logits[None] if logits.ndim == 1 else logits
    words = np.asarray(mask, dtype=np.int32).reshape(rows.shape[0], -1).view(np.uint32)
    ids = np.arange(rows.shape[-1])
    word = ids // 32
    bits = (words[:, np.minimum(word, words.shape[1] - 1)] >> (ids % 32).astype(np.uint32)) & 1
    keep = mx.array((bits == 1) & (word < words.shape[1]))
    out = mx.where(keep, rows, mx.array(float("-inf"), dtype=logits.dtype))
    return out[0] if logits.ndim == 1 else out


def mask_kernel_site() -> List[tuple]:
    """(module, attribute) of the Metal mask the pin's structured output calls: mlx-vlm's own
    ``_apply_llguidance_mask`` (0.6.12+), else llguidance's ``apply_token_bitmask`` (0.6.3)."""
    import importlib

    structured = importlib.import_module("mlx_vlm.structured")
    if hasattr(structured, "_apply_llguidance_mask"):
        return [(structured, "_apply_llguidance_mask")]
    return [(importlib.import_module("llguidance.mlx"), "apply_token_bitmask")]


def install_cpu_mask() -> None:
    """Swap the pin's Metal mask for :func:`cpu_bitmask` in this process (a server under test)."""
    for module, name in mask_kernel_site():
        setattr(module, name, cpu_bitmask)
