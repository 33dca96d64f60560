"""``python -m compass_compat server``: mlx-vlm's own server, patched, on 127.0.0.1.

- An OpenAI-style request with an image data URI and text gives the same greedy text as
  ``python -m compass_compat generate`` for the same checkpoint, image and prompt.
- Malformed image inputs get a clear 400 from the launcher's guard
  (``compass_compat.server_guard``) and the server keeps serving.
- Without the guard (``--no-guard``) each pin's own answer is recorded below: every pin
  from 0.3.9 to 0.7.10 answers 500 (the image fails to load inside generation, whose
  handlers map everything to 500), and keeps serving.

Routes per pin (read from each pin's server code, checked here):
- 0.3.x: ``/responses``. Its ``/chat/completions`` passes the OpenAI content list as the
  message text to ``apply_chat_template``, so list-format models (qwen2/3-vl, cohere_compass)
  get the list's repr, base64 included, as their prompt.
- 0.4.x: ``/v1/responses``. Its ``/v1/chat/completions`` calls mlx-lm's
  ``_infer_tool_parser(tokenizer.chat_template)``; mlx-lm >= 0.32 (what the pin resolves)
  takes the tokenizer there, so every chat completion fails with 500, whatever the model.
- 0.6 and later: ``/v1/chat/completions``.
"""

from __future__ import annotations

import base64
import json
import signal
from pathlib import Path

import pytest

pytest.importorskip(
    "uvicorn", reason="mlx-vlm's server needs uvicorn and fastapi (installed with mlx-vlm on every pin)"
)

import compass_compat
from compass_compat import server_guard
from scripts._lib.server import MAX_TOKENS, VERSION, Server, data_uri, reply_text, serving
from tests.lib.cli_run import greedy_cli_output  # noqa: E402

# What each pin's own server answers for an image it cannot load (no guard).
UNGUARDED_STATUS = {"0.3.9": 500, "0.4.4": 500, "0.6.12": 500, "0.7.10": 500}
PROMPT = "Describe the image."
MAX_IMAGES = 2


@pytest.fixture(scope="module")
def image(fixture_images) -> Path:
    return fixture_images["synth_320x256.png"]


@pytest.fixture(scope="module")
def servers(tiny_ckpt_original, tmp_path_factory):
    """Both servers start at once (they import mlx-vlm in parallel); stopped at the end."""
    logs = tmp_path_factory.mktemp("server_logs")
    started = {
        "guarded": Server(tiny_ckpt_original, logs / "guarded.log", "--max-images", str(MAX_IMAGES)),
        "unguarded": Server(tiny_ckpt_original, logs / "unguarded.log", "--no-guard"),
    }
    with serving(started):
        yield started


@pytest.fixture(scope="module")
def cli_text(tiny_ckpt_original, image) -> str:
    """What ``python -m compass_compat generate`` prints for the same checkpoint, image and prompt."""
    return greedy_cli_output(tiny_ckpt_original, PROMPT, MAX_TOKENS, image).rstrip("\n")


def good_request(image: Path) -> list:
    return [{"type": "image_url", "image_url": {"url": data_uri(image.read_bytes())}}, {"type": "text", "text": PROMPT}]


def test_server_gives_the_cli_greedy_text(servers, cli_text, image):
    assert cli_text.strip()
    for name, server in servers.items():
        status, body = server.post(good_request(image))
        assert status == 200, f"{name}: {status} {body}\n{server.tail()}"
        assert reply_text(body).strip() == cli_text.strip(), name


def malformed(image: Path) -> dict:
    png = image.read_bytes()
    return {
        "bad base64": ("data:image/png;base64,@@@ not base64 @@@", "not valid base64"),
        "not an image": (data_uri(b"definitely not a picture"), "not a readable image"),
        "truncated image": (data_uri(png[: len(png) // 3]), "not a readable image"),
        "missing file": ("/nonexistent/compass-compat/pic.png", "image file not found"),
    }


@pytest.mark.parametrize("case", ["bad base64", "not an image", "truncated image", "missing file"])
def test_malformed_image_gets_400_and_the_server_keeps_serving(servers, cli_text, image, case):
    url, words = malformed(image)[case]
    server = servers["guarded"]
    status, body = server.post([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}])
    assert status == 400, f"{case}: {status} {body}"
    assert words in body["error"]["message"] and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] in ("messages[0].content[0]", "input[0].content[0]")
    status, body = server.post(good_request(image))
    assert status == 200 and reply_text(body).strip() == cli_text.strip(), f"after {case}: {status} {body}"


def test_more_images_than_allowed_gets_400(servers, cli_text, image):
    server = servers["guarded"]
    part = good_request(image)[0]
    status, body = server.post([part] * (MAX_IMAGES + 1) + [{"type": "text", "text": PROMPT}])
    assert status == 400 and f"at most {MAX_IMAGES}" in body["error"]["message"], body
    assert body["error"]["code"] == "too_many_images"
    status, body = server.post([part] * MAX_IMAGES + [{"type": "text", "text": PROMPT}])
    assert status == 200 and reply_text(body).strip(), f"{MAX_IMAGES} images are allowed: {status} {body}"
    status, body = server.post(good_request(image))
    assert status == 200 and reply_text(body).strip() == cli_text.strip()


@pytest.mark.parametrize("case", ["bad base64", "not an image"])
def test_without_the_guard_each_pin_answers_its_own_status_and_keeps_serving(servers, cli_text, image, case):
    url, _ = malformed(image)[case]
    server = servers["unguarded"]
    status, body = server.post([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}])
    expected = UNGUARDED_STATUS.get(str(VERSION))
    if expected is None:  # a pin not recorded above: any error status, but say what it was
        assert status >= 400, f"mlx-vlm {VERSION} accepted a malformed image: {status} {body}"
    else:
        assert status == expected, f"mlx-vlm {VERSION} now answers {status} (recorded: {expected}): {body}"
    status, body = server.post(good_request(image))
    assert status == 200 and reply_text(body).strip() == cli_text.strip(), f"after {case}: {status} {body}"


# ------------------------------------------------------------- the guard, in-process


def test_guard_finds_images_in_chat_and_responses_requests():
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u1"}}],
            },
            {"role": "user", "content": [{"type": "input_image", "image_url": "u2"}]},
        ]
    }
    responses = {
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "u3"}],
            },
            {"type": "input_image", "image_url": {"url": "u4"}},
        ]
    }
    assert [(r.where, r.source) for r in server_guard.image_refs(chat)] == [
        ("messages[1].content[1]", "u1"),
        ("messages[2].content[0]", "u2"),
    ]
    assert [(r.where, r.source) for r in server_guard.image_refs(responses)] == [
        ("input[0].content[1]", "u3"),
        ("input[1]", "u4"),
    ]
    assert server_guard.image_refs({"messages": "not a list"}) == []


def test_guard_accepts_what_mlx_vlm_can_load(image):
    raw = image.read_bytes()
    wrapped = base64.encodebytes(raw).decode("ascii")  # MIME line breaks: mlx-vlm's decoder skips them
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_uri(raw)}},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + wrapped}},
                    {"type": "image_url", "image_url": {"url": str(image)}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/not-fetched.png"}},
                ],
            }
        ]
    }
    server_guard.check_request(json.dumps(body).encode(), max_images=4)
    server_guard.check_request(b"", max_images=4)  # no body: the server's own validation answers


@pytest.mark.parametrize(
    "url, words",
    [
        ("data:text/plain;base64,aGVsbG8=", "media type must be image/*"),
        ("data:image/png,rawbytes", "only base64 data URIs"),
        ("data:image/png;base64", "no comma"),
        ("", "has no URL"),
    ],
)
def test_guard_rejects_malformed_data_uris(url, words):
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    with pytest.raises(server_guard.BadRequest, match=words):
        server_guard.check_request(json.dumps(body).encode(), max_images=4)
    with pytest.raises(server_guard.BadRequest, match="not valid JSON"):
        server_guard.check_request(b"{not json", max_images=4)


@pytest.mark.parametrize(
    "path, guarded",
    [
        ("/chat/completions", True),
        ("/v1/chat/completions", True),
        ("/v1/responses/", True),
        ("/responses/input_tokens", False),
        ("/v1/models", False),
        ("/health", False),
    ],
)
def test_guard_routes(path, guarded):
    assert server_guard.guarded(path) is guarded


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_without_model_the_server_serves_the_default_checkpoint_and_stops_with_exit_0(tmp_path, stop_signal):
    """`python -m compass_compat server` with no --model serves the default checkpoint, as
    `generate` does (it once loaded nothing until a request named a model), and logs which
    cohere_compass is live. Ctrl+C or SIGTERM, after a request, end it with exit code 0 and no
    abort (mlx-vlm's own server aborts in MLX's thread-local destructors at exit: docs/hosts.md)."""
    with Server(None, tmp_path / "server.log") as server:
        status, body = server.post([{"type": "text", "text": "Say hello."}], max_tokens=4)
        code = server.stop(stop_signal)
        log = server.tail(200)
    assert status == 200, (body, log)
    live = compass_compat.implementation_info().implementation  # the server inherits the switch
    assert "serving the default checkpoint" in log and f"cohere_compass: {live} live" in log, log
    assert code == 0 and "terminate called" not in log, (code, log)
    assert "Application shutdown complete" in log, log  # uvicorn's graceful shutdown ran first
