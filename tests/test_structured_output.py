"""Structured output: ``logits_processors`` through mlx-vlm's ``generate`` / ``stream_generate``, and
the server's ``response_format`` (a JSON schema), on ours.

The processors are our own (tests/support/json_mask.py): one that changes nothing, one that allows only
the ids of a fixed JSON document in order, and a mask that keeps the answer a prefix of one of a
schema's listed documents. Expected values: transformers' recorded greedy answers (a processor that
changes nothing must give them) and prefill logits (the best allowed digit), the tokenizer's ids of
the fixed document, the schema itself.

mlx-vlm's own ``response_format`` support (``mlx_vlm.structured``, 0.6+) masks the logits with
llguidance through an MLX Metal kernel (0.6.3: llguidance's own ``llguidance.mlx`` kernel; 0.6.12
and 0.7.x: mlx-vlm's). Without Metal it raises ``RuntimeError: [metal_kernel] No Metal back-end.``,
whatever the model: the server answers 500 (a stream sends an error event), never an unconstrained
answer. With that one kernel replaced by a CPU mask (in process, or in the server through a
``sitecustomize``), the pin's grammar and server path run on ours.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import urllib.error
import urllib.request
from typing import List

import mlx.core as mx
import numpy as np
import pytest

from compass_data import toy
from tests.support import mlx_vlm_run
from tests.support.json_mask import (
    DIGIT_SCHEMA,
    FIXED,
    SCHEMA,
    ChoiceMask,
    FixedIds,
    Identity,
    check_calls,
    cpu_bitmask,
    documents,
    mask_kernel_site,
    matches,
    tokenizer_pieces,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOY_REFERENCE = json.loads((ROOT / "tests" / "fixtures" / "toy_reference.json").read_text())
DEMO = ROOT / "compass_compat" / "assets" / "demo.png"
MAX_TOKENS = 40  # more than any listed document takes, so each answer ends at its EOS
NO_METAL = "[metal_kernel] No Metal back-end"


PIN_STRUCTURED = importlib.util.find_spec("mlx_vlm.structured") is not None
needs_pin_structured = pytest.mark.skipif(
    not PIN_STRUCTURED, reason="this mlx-vlm has no mlx_vlm.structured (response_format came in 0.6)"
)
cpu_only = pytest.mark.skipif(mx.metal.is_available(), reason="measures the pin's Metal-only mask on a CPU")


# --------------------------------------------------------------------------- ours
class Ours:
    """A checkpoint of ours loaded by mlx-vlm: its tokenizer's pieces over the model's logits."""

    def __init__(self, folder: pathlib.Path):
        config = json.loads((folder / "config.json").read_text())
        self.vocab = config["text_config"]["vocab_size"]
        eos = config["eos_token_id"]
        self.eos = list(eos) if isinstance(eos, list) else [eos]
        self.loaded = mlx_vlm_run.load(str(folder))
        self.tokenizer = self.loaded[1].tokenizer
        self.pieces = tokenizer_pieces(self.tokenizer, self.vocab)
        self.fed: List[np.ndarray] = []

    def prompt(self, text: str, images: List[str]) -> str:
        return mlx_vlm_run.chat_prompt(self.loaded, text, len(images))

    def stream(self, prompt: str, images: List[str], processors=None) -> List[int]:
        """Greedy ids of ``stream_generate``; the ids the model was fed go to ``self.fed``."""
        self.fed = []
        kwargs = {} if processors is None else {"logits_processors": processors}
        return mlx_vlm_run.greedy_ids(self.loaded, prompt, images, MAX_TOKENS, fed=self.fed, **kwargs)

    def prompt_ids(self) -> List[int]:
        return self.fed[-1]["input_ids"].reshape(-1).tolist()


@pytest.fixture(scope="module")
def tiny(tiny_ckpt_original) -> Ours:
    from tests.support.vendored import vendored

    vendored()
    return Ours(tiny_ckpt_original)


@pytest.fixture(scope="module")
def default(tiny) -> Ours:  # after `tiny`, which skips where upstream's cohere_compass is live
    return Ours(toy.ensure_default_checkpoint())


def _cut_at_eos(ids, eos: List[int]) -> List[int]:
    """``ids`` up to and with the first end-of-sequence id (stream_generate hands that one out)."""
    ids = [int(i) for i in ids]
    end = next((k for k, i in enumerate(ids) if i in eos), None)
    return ids if end is None else ids[: end + 1]


@pytest.mark.parametrize("name", ["text_short", "img_448"])
def test_identity_processor_gives_the_reference_greedy_tiny(tiny, reference, fixture_images, name):
    """A processor that changes nothing: the ids are transformers' greedy ids, as without it."""
    case = reference(name)
    images = [str(fixture_images[f]) for f in case["meta"]["images"]]
    want = _cut_at_eos(case["greedy_ids"], tiny.eos)
    plain = tiny.stream(case["meta"]["prompt"], images)
    identity = Identity()
    got = tiny.stream(case["meta"]["prompt"], images, [identity])
    assert tiny.prompt_ids() == case["input_ids"].reshape(-1).tolist()
    assert got == plain
    assert got[: len(want)] == want[: len(got)] and len(got) >= min(len(want), MAX_TOKENS)
    check_calls(identity, case["input_ids"].reshape(-1).tolist(), got, tiny.vocab, tiny.eos)


@pytest.mark.parametrize("question", ["Say hello.", "describe", "count"])
def test_identity_processor_gives_the_reference_answer_default(default, question):
    """The default checkpoint: transformers' recorded answer (text, or a question on the demo)."""
    if question in TOY_REFERENCE["demo"]:
        case, images = TOY_REFERENCE["demo"][question], [str(DEMO)]
    else:
        case, images = next(c for c in TOY_REFERENCE["text_only"] if c["prompt"] == question), []
    prompt = default.prompt(case["prompt"], images)
    identity = Identity()
    got = default.stream(prompt, images, [identity])
    assert got == _cut_at_eos(case["ids"], default.eos)
    check_calls(identity, default.prompt_ids(), got, default.vocab, default.eos)


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_fixed_document_through_generate(request, which):
    """``generate`` with a processor that allows only the tokenizer's ids of FIXED, then EOS: the
    text is FIXED, which parses and matches the schema."""
    from mlx_vlm import generate

    ours: Ours = request.getfixturevalue(which)
    target = ours.tokenizer.encode(FIXED, add_special_tokens=False)
    assert ours.tokenizer.decode(target) == FIXED
    fixed = FixedIds(target, ours.eos)
    prompt = ours.prompt("Describe this picture as JSON.", [str(DEMO)])
    result = generate(
        *ours.loaded, prompt, image=[str(DEMO)], max_tokens=MAX_TOKENS, temperature=0.0, logits_processors=[fixed]
    )
    text = getattr(result, "text", result)
    assert text == FIXED
    assert matches(SCHEMA, json.loads(text))
    prompt_length = len(fixed.calls[0].context)
    assert fixed.calls[-1].context[prompt_length:] == target + ours.eos[:1]
    check_calls(fixed, fixed.calls[0].context, target, ours.vocab, ours.eos)


@pytest.mark.parametrize(
    "which, text, with_image",
    [
        ("tiny", "Hello there!", False),
        ("tiny", "What is in the picture?", True),
        ("default", "describe", True),
        ("default", "How many shapes are there? Answer in JSON.", False),
    ],
)
def test_schema_mask_through_stream_generate(request, which, text, with_image):
    """The schema mask: the answer parses and matches the schema; each sampled id was allowed."""
    ours: Ours = request.getfixturevalue(which)
    text = TOY_REFERENCE["demo"].get(text, {}).get("prompt", text)
    images = [str(DEMO)] if with_image else []
    mask = ChoiceMask(documents(), ours.pieces, ours.eos)
    ids = ours.stream(ours.prompt(text, images), images, [mask])
    answer = ours.tokenizer.decode(ids, skip_special_tokens=True)
    assert answer in documents() and matches(SCHEMA, json.loads(answer))
    check_calls(mask, ours.prompt_ids(), ids, ours.vocab, ours.eos)
    assert mask.calls[-1].context[-1] in ours.eos  # stopped at its end of sequence, not max_tokens


@pytest.mark.parametrize("name", ["text_short", "img_448"])
def test_digit_document_takes_the_references_best_digit(tiny, reference, fixture_images, name):
    """A one-digit document: the digit is the best of the ten by transformers' recorded logits of
    the prompt's last position (independent of ours), then EOS."""
    case = reference(name)
    images = [str(fixture_images[f]) for f in case["meta"]["images"]]
    mask = ChoiceMask(documents(DIGIT_SCHEMA), tiny.pieces, tiny.eos)
    ids = tiny.stream(case["meta"]["prompt"], images, [mask])
    allowed = mask.calls[0].allowed
    assert sorted(tiny.pieces[i] for i in allowed) == [str(d) for d in range(10)]
    want = allowed[int(np.argmax(case["prefill_logits"][-1][allowed]))]
    assert ids[0] == want and ids[1:] == tiny.eos[:1]
    answer = tiny.tokenizer.decode(ids, skip_special_tokens=True)
    assert matches(DIGIT_SCHEMA, json.loads(answer))


# --------------------------------------------------------------------------- the pin's llguidance mask
def _pin_processor(tokenizer):
    from mlx_vlm.structured import build_json_schema_logits_processor

    return build_json_schema_logits_processor(tokenizer, SCHEMA)


@needs_pin_structured
@cpu_only
def test_pin_mask_needs_metal_ours(tiny):
    prompt = tiny.prompt("Hello there!", [])
    with pytest.raises(RuntimeError, match=NO_METAL.replace("[", r"\[").replace("]", r"\]")):
        tiny.stream(prompt, [], [_pin_processor(tiny.tokenizer)])


@pytest.fixture
def cpu_mask(monkeypatch):
    """The pin's Metal mask replaced by a CPU one (tests/support/json_mask.py ``cpu_bitmask``), so the
    rest of its structured path runs here."""
    for module, name in mask_kernel_site():
        monkeypatch.setattr(module, name, cpu_bitmask)


@needs_pin_structured
@pytest.mark.parametrize("which, with_image", [("tiny", False), ("default", True)])
def test_pin_grammar_with_a_cpu_mask(request, cpu_mask, which, with_image):
    """The pin's llguidance grammar for SCHEMA over our tokenizer and padded logits: the answer
    parses and matches the schema."""
    ours: Ours = request.getfixturevalue(which)
    images = [str(DEMO)] if with_image else []
    ids = ours.stream(ours.prompt("Describe this picture as JSON.", images), images, [_pin_processor(ours.tokenizer)])
    answer = ours.tokenizer.decode(_cut_at_eos(ids, ours.eos), skip_special_tokens=True)
    assert matches(SCHEMA, json.loads(answer)), answer


# --------------------------------------------------------------------------- the server
def _server_has_response_format() -> bool:
    from mlx_vlm import server

    path = pathlib.Path(server.__file__)
    files = [path] if path.name != "__init__.py" else sorted(path.parent.glob("*.py"))
    return PIN_STRUCTURED and any("_build_structured_logits_processors" in f.read_text() for f in files)


def _post(server, body: dict) -> tuple:
    try:
        with urllib.request.urlopen(server.request(body, route="/v1/chat/completions"), timeout=120) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", "replace")


def _server(tmp_path, *paths: str, structured: bool = True):
    """The default checkpoint served by ``python -m compass_compat server``, this tree (and
    ``paths``) first on its PYTHONPATH; skipped unless the pin's server has response_format
    (``structured``) or has none (``structured=False``)."""
    from tests.support.server import Server

    if structured and not _server_has_response_format():
        pytest.skip("this mlx-vlm's server has no response_format (mlx_vlm.structured came in 0.6)")
    if not structured and _server_has_response_format():
        pytest.skip("this mlx-vlm's server has response_format (tested above)")
    return Server(toy.ensure_default_checkpoint(), tmp_path / "server.log", path=paths)


def _chat(server, text: str, **extra) -> dict:
    return dict(
        {
            "model": server.model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "stream": False,
        },
        **extra,
    )


RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "shapes", "schema": SCHEMA}}


@cpu_only
def test_server_response_format_on_cpu(tmp_path):
    """A JSON-schema request: 500 naming the missing Metal back-end (a stream: one error event and
    no text), never an unconstrained answer; the same request without response_format answers."""
    case = TOY_REFERENCE["text_only"][0]
    with _server(tmp_path) as server:
        status, text = _post(server, _chat(server, case["prompt"], response_format=RESPONSE_FORMAT))
        assert status == 500 and NO_METAL in json.loads(text)["detail"], (status, text, server.tail())
        status, text = _post(server, _chat(server, case["prompt"], response_format=RESPONSE_FORMAT, stream=True))
        events = [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: {")]
        assert status == 200 and len(events) == 1 and NO_METAL in events[0]["error"], (status, text)
        status, text = _post(server, _chat(server, case["prompt"]))
        assert status == 200, (text, server.tail())
        assert json.loads(text)["choices"][0]["message"]["content"].strip() == case["expected"]


def test_server_response_format_with_a_cpu_mask(tmp_path):
    """The server's own structured path (llguidance grammar, its batch generator's processors) on
    ours, with only the Metal mask swapped for the CPU one (a sitecustomize in the server): the
    answer, whole or streamed, parses and matches the schema."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "from tests.support.json_mask import install_cpu_mask\n\ninstall_cpu_mask()\n", encoding="utf-8"
    )
    prompt = TOY_REFERENCE["demo"]["describe"]["prompt"]
    with _server(tmp_path, str(site)) as server:
        status, text = _post(server, _chat(server, prompt, response_format=RESPONSE_FORMAT))
        assert status == 200, (text, server.tail())
        answer = json.loads(text)["choices"][0]["message"]["content"]
        assert matches(SCHEMA, json.loads(answer)), answer
        status, text = _post(server, _chat(server, prompt, response_format=RESPONSE_FORMAT, stream=True))
        events = [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: {")]
        assert status == 200 and not any("error" in e for e in events), text
        streamed = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
        assert streamed == answer


def test_server_without_response_format_ignores_it(tmp_path):
    """A pin whose server has no response_format (0.4.x) accepts the field (its request
    models allow extra fields) and answers unconstrained: transformers' plain answer, not JSON.
    The field never reaches the model, so only the pin could refuse it."""
    case = TOY_REFERENCE["text_only"][0]
    with _server(tmp_path, structured=False) as server:
        status, text = _post(server, _chat(server, case["prompt"], response_format=RESPONSE_FORMAT))
    assert status == 200, (text, server.tail())
    assert json.loads(text)["choices"][0]["message"]["content"].strip() == case["expected"]
