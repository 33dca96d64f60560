"""Ids past the tokenizer (vocabulary padding rows) decode to nothing, as in transformers.

The published checkpoint has 255035 tokenizer entries and 262144 embedding rows; the tiny one
has the same shape of gap (``tokenizer_vocab_size()`` entries, more rows). The head is tied,
so a padding row can win the argmax at temperature > 0 (or greedily, as here). The logits stay
the reference's (no masking); decoding follows the reference tokenizer, which decodes such an
id to '' (measured on every pin). mlx-vlm's own BPEStreamingDetokenizer (chosen for the
tokenizer's ByteLevel decoder) raises IndexError on it. Our processor guards whatever detokenizer
``load_processor`` assigns (``processor.detokenizer``).

A checkpoint whose padding rows win: the tiny checkpoint with its padding embedding rows
scaled up, so greedy decoding mixes padding and real ids.
"""

from __future__ import annotations

import copy
import importlib
import json
import urllib.request

import mlx_vlm
import numpy as np
import pytest
from packaging.version import Version
from safetensors.numpy import load_file

from compass_data.tiny import build_tiny_checkpoint, save_safetensors, tokenizer_vocab_size
from tests.support.cli_run import greedy_cli_output  # noqa: E402
from tests.support.vendored import vendored

vendored()  # the guard is our processor's: skip (saying why) where upstream's package is live

VERSION = Version(str(mlx_vlm.__version__))
PROMPT = "Describe this picture."
MAX_TOKENS = 24
# Padding rows are small in the tiny weights; x12 makes some (not all) of them win greedily.
PADDING_SCALE = 12.0
EMBED = "model.language_model.embed_tokens.weight"


@pytest.fixture(scope="module")
def padded_ckpt(tmp_path_factory):
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("padding_wins"))
    weights = load_file(str(path / "model.safetensors"))
    rows = tokenizer_vocab_size()
    assert weights[EMBED].shape[0] > rows, (
        f"the tiny checkpoint has no padding rows ({weights[EMBED].shape[0]} rows, {rows} tokenizer "
        "entries); compass_data.tiny must make vocab_size exceed the tokenizer"
    )
    weights[EMBED][rows:] *= np.float32(PADDING_SCALE)
    save_safetensors(path / "model.safetensors", weights)
    return path


@pytest.fixture(scope="module")
def reference_tokenizer(padded_ckpt):
    """transformers' own tokenizer of the folder (not our processor's guarded one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(padded_ckpt))


@pytest.fixture(scope="module")
def loaded(padded_ckpt):
    return mlx_vlm.load(str(padded_ckpt))


@pytest.fixture(scope="module")
def prompt(loaded):
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = loaded
    return apply_chat_template(processor, model.config, PROMPT, num_images=0)


@pytest.fixture(scope="module")
def streamed(loaded, prompt):
    """(generated ids, streamed text) of greedy mlx_vlm.stream_generate."""
    model, processor = loaded
    ids, text = {}, ""
    for chunk in mlx_vlm.stream_generate(model, processor, prompt, max_tokens=MAX_TOKENS, temperature=0.0):
        text += chunk.text
        if chunk.token is not None:  # the closing chunk repeats the last token (0.6+)
            ids[chunk.generation_tokens] = int(chunk.token)
    return [ids[n] for n in sorted(ids)], text


def reference_text(tokenizer, ids) -> str:
    # mlx-vlm's default: skip_special_tokens False (no skip ids passed to the detokenizer).
    return tokenizer.decode(ids, skip_special_tokens=False)


# ------------------------------------------------------------- the reference and the pin


def test_reference_decodes_padding_ids_to_nothing(reference_tokenizer):
    size = len(reference_tokenizer)
    assert size == tokenizer_vocab_size()
    a, b = 10, 11
    assert reference_tokenizer.decode([a, size + 3, b]) == reference_tokenizer.decode([a, b])
    assert reference_tokenizer.convert_ids_to_tokens([size + 3]) == [None]


def test_the_pins_own_detokenizer_unguarded(loaded, reference_tokenizer):
    """Why the guard exists: what the class mlx-vlm picked does with a padding id on its own."""
    from mlx_vlm.tokenizer_utils import BPEStreamingDetokenizer

    _, processor = loaded
    original = type(processor.detokenizer)._compass_original_class
    bare = original(reference_tokenizer)
    bare.reset()
    assert issubclass(original, BPEStreamingDetokenizer)  # for a ByteLevel tokenizer.json
    with pytest.raises(IndexError):
        bare.add_token(len(reference_tokenizer) + 3)


def test_guard_keeps_the_detokenizer_interface(loaded):
    _, processor = loaded
    detokenizer = processor.detokenizer
    original = type(detokenizer)._compass_original_class
    assert isinstance(detokenizer, original)  # mlx-vlm >= 0.6 servers pick their streamer by class
    assert type(detokenizer).__name__ == original.__name__
    for name in ("reset", "add_token", "finalize", "text", "last_segment", "tokens"):
        assert hasattr(detokenizer, name), name
    processor.detokenizer = detokenizer  # assigning again does not wrap twice
    assert type(processor.detokenizer) is type(detokenizer)
    # Where mlx-vlm copies it per request (tokenizer_utils.make_streaming_detokenizer, 0.6 on), the
    # copy keeps the guard.
    if hasattr(importlib.import_module("mlx_vlm.tokenizer_utils"), "make_streaming_detokenizer"):
        twin = copy.copy(detokenizer)
        assert type(twin) is type(detokenizer) and twin._compass_vocab_size == len(processor.tokenizer)


# ------------------------------------------------------------- mlx-vlm's generation paths


def test_stream_generate_skips_padding_ids_like_the_reference(streamed, reference_tokenizer):
    ids, text = streamed
    rows = tokenizer_vocab_size()
    assert any(i >= rows for i in ids) and any(i < rows for i in ids), (
        f"the padding rows should win some steps, not all (PADDING_SCALE needs retuning): {ids}"
    )
    assert text == reference_text(reference_tokenizer, ids)


def test_generate_gives_the_same_text(loaded, prompt, streamed, reference_tokenizer):
    model, processor = loaded
    result = mlx_vlm.generate(model, processor, prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    text = result if isinstance(result, str) else result.text
    assert text == reference_text(reference_tokenizer, streamed[0])


def test_cli_generate_gives_the_same_text(padded_ckpt, streamed, reference_tokenizer):
    out = greedy_cli_output(padded_ckpt, PROMPT, MAX_TOKENS)
    assert out.rstrip("\n") == reference_text(reference_tokenizer, streamed[0]).rstrip("\n")


@pytest.mark.skipif(
    VERSION < Version("0.6"),
    reason="streaming chat completions: mlx-vlm >= 0.6 (0.3/0.4 "
    "serve /responses; 0.4's chat completions fail on mlx-lm 0.32, see test_server.py)",
)
def test_server_streaming_skips_padding_ids(padded_ckpt, streamed, reference_tokenizer, tmp_path):
    from tests.support import server as ts

    with ts.Server(padded_ckpt, tmp_path / "server.log") as server:
        body = {
            "model": str(padded_ckpt),
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "stream": True,
        }
        request = server.request(body, "/v1/chat/completions")
        deltas = []
        with urllib.request.urlopen(request, timeout=ts.REQUEST_TIMEOUT) as response:
            assert response.status == 200
            for line in response.read().decode("utf-8").splitlines():
                if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                    for choice in json.loads(line[6:]).get("choices", []):
                        deltas.append(choice.get("delta", {}).get("content") or "")
    assert "".join(deltas) == reference_text(reference_tokenizer, streamed[0]), server.tail()
