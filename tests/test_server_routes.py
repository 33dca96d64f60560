"""mlx-vlm's server routes beyond chat completions, with this model.

Each route is probed on the running server (a route the pin lacks answers 404), never read from
the version number:
- Anthropic-style ``/v1/messages`` (0.6 and later): a text and a picture request, and the
  streamed text request, give ``python -m compass_compat generate``'s greedy text.
- The responses route (``/v1/responses``, 0.4 and later): the same three.
- ``/v1/embeddings`` (0.6 and later): the pin serves ``text_embeds`` from a model's output, which
  only its embedding models produce; a generative VLM is refused by the pin by name (400), for
  text and for a picture. The same verdict in-process through the pin's own embedding loader and
  call (``mlx_vlm.embedding_loader.load_embedding_model``; ``model(ids, attention_mask=)``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest

pytest.importorskip(
    "uvicorn", reason="mlx-vlm's server needs uvicorn and fastapi (installed with mlx-vlm on every pin)"
)

from tests.support.cli_run import greedy_cli_output  # noqa: E402
from tests.support.server import (  # noqa: E402
    MAX_TOKENS,
    ROUTE_PATHS,
    Server,
    has_route,
    messages_body,
    reply_text,
    responses_body,
    send,
    serving,
)

TEXT_PROMPT = "Hello there"
IMAGE_PROMPT = "Describe the image."
# The pin's own refusals (mlx_vlm/server/embeddings.py, 0.6.12 and 0.7.10).
NO_TEXT_EMBEDDINGS = "The loaded model does not produce embeddings."
NO_IMAGE_EMBEDDINGS = "The loaded embedding model does not support image inputs."


@pytest.fixture(scope="module")
def image(fixture_images) -> Path:
    return fixture_images["synth_320x256.png"]


@pytest.fixture(scope="module")
def image_b64(image) -> str:
    import base64

    return base64.b64encode(image.read_bytes()).decode("ascii")


@pytest.fixture(scope="module")
def servers(tiny_ckpt_original, tmp_path_factory):
    """Our server; stopped at the end."""
    started = {"ours": Server(tiny_ckpt_original, tmp_path_factory.mktemp("route_logs") / "ours.log")}
    with serving(started):
        yield started


@pytest.fixture(scope="module")
def cli_texts(tiny_ckpt_original, image) -> dict:
    """``compass_compat generate``'s greedy text for the text and the picture request."""
    return {
        "text": greedy_cli_output(tiny_ckpt_original, TEXT_PROMPT, MAX_TOKENS).rstrip("\n"),
        "image": greedy_cli_output(tiny_ckpt_original, IMAGE_PROMPT, MAX_TOKENS, image).rstrip("\n"),
    }


def sse_events(raw: bytes) -> List[dict]:
    """The JSON payloads of a server-sent-events body, in order (``[DONE]`` dropped)."""
    events = []
    for line in raw.decode("utf-8").splitlines():
        if line.startswith("data:"):
            data = line[len("data:") :].strip()
            if data and data != "[DONE]":
                events.append(json.loads(data))
    return events


# ------------------------------------------------------------- request bodies per route


def messages_text(raw: bytes) -> str:
    body = json.loads(raw)
    assert body["type"] == "message" and body["role"] == "assistant", body
    return "".join(part["text"] for part in body["content"] if part["type"] == "text")


def messages_stream_text(raw: bytes) -> str:
    events = sse_events(raw)
    assert events and events[-1]["type"] == "message_stop", raw[-400:]
    return "".join(
        e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"
    )


def responses_text(raw: bytes) -> str:
    return reply_text(json.loads(raw))


def responses_stream_text(raw: bytes) -> str:
    events = sse_events(raw)
    deltas = [e["delta"] for e in events if e.get("type") == "response.output_text.delta"]
    assert deltas, f"no response.output_text.delta events: {raw[:600]!r}"
    done = [e for e in events if e.get("type") == "response.completed"]
    if done:  # the final event carries the whole text too: it must agree with the deltas
        assert responses_text(json.dumps(done[-1]["response"]).encode()) == "".join(deltas)
    return "".join(deltas)


ROUTES = {
    # name: (routes to try, first found wins; body builder; reader; streamed reader)
    "messages": (ROUTE_PATHS["messages"], messages_body, messages_text, messages_stream_text),
    "responses": (ROUTE_PATHS["responses"], responses_body, responses_text, responses_stream_text),
}


def found_route(server: Server, name: str) -> str:
    for route in ROUTES[name][0]:
        if has_route(server, route):
            return route
    pytest.skip(f"this mlx-vlm's server has no {name} route ({', '.join(ROUTES[name][0])} answer 404)")


# ------------------------------------------------------------- ours: the CLI's text


@pytest.mark.parametrize("name", sorted(ROUTES))
@pytest.mark.parametrize("kind", ["text", "image", "streamed text"])
def test_route_gives_the_cli_greedy_text(servers, cli_texts, image_b64, name, kind):
    server = servers["ours"]
    route = found_route(server, name)
    _, build, read, read_stream = ROUTES[name]
    prompt = IMAGE_PROMPT if kind == "image" else TEXT_PROMPT
    body = build(server.model, prompt, image_b64 if kind == "image" else "", stream=kind == "streamed text")
    status, raw = send(server, route, body)
    assert status == 200, f"{route} {kind}: {status} {raw[:600]!r}\n{server.tail()}"
    text = (read_stream if kind == "streamed text" else read)(raw)
    expected = cli_texts["image" if kind == "image" else "text"]
    assert expected.strip()
    assert text.strip() == expected.strip(), f"{route} {kind}"


# ------------------------------------------------------------- embeddings


def embeddings_route_or_skip(server: Server) -> str:
    if not has_route(server, "/v1/embeddings"):
        pytest.skip("this mlx-vlm's server has no /v1/embeddings route")
    return "/v1/embeddings"


def test_embeddings_refuse_this_model_by_name(servers, image_b64):
    """Text and a picture: the pin's own 400, which names why; the server keeps serving."""
    server = servers["ours"]
    route = embeddings_route_or_skip(server)
    for item, detail in (
        (TEXT_PROMPT, NO_TEXT_EMBEDDINGS),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + image_b64}}, NO_IMAGE_EMBEDDINGS),
    ):
        status, raw = send(server, route, {"model": server.model, "input": [item]})
        assert status == 400, f"{status} {raw[:600]!r}\n{server.tail()}"
        assert json.loads(raw)["detail"] == detail
    _, build, read, _ = ROUTES["responses"]
    status, raw = send(server, found_route(server, "responses"), build(server.model, TEXT_PROMPT))
    assert status == 200 and read(raw).strip(), f"after the refusals: {status} {raw[:400]!r}"


def test_the_pins_embedding_call_gives_no_text_embeds(tiny_ckpt_original):
    """What the route runs after tokenizing, in-process: the pin's embedding loader, then
    ``model(input_ids, attention_mask=)``. A generative VLM (ours, as the pin's own qwen3_vl)
    has no ``text_embeds`` in its output, which is what the route's refusal reads."""
    pytest.importorskip("mlx_vlm.embedding_loader", reason="this mlx-vlm has no embedding loader (no embeddings)")
    import mlx.core as mx
    from mlx_vlm.embedding_loader import load_embedding_model

    model = load_embedding_model(Path(tiny_ckpt_original))
    ids = mx.array([[5, 6, 7, 8]], dtype=mx.int32)
    out = model(ids, attention_mask=mx.ones(ids.shape, dtype=mx.int32))
    logits = getattr(out, "logits", out)
    assert logits.shape[:2] == (1, 4)  # it ran: a generation output, one row per token
    assert getattr(out, "text_embeds", None) is None
