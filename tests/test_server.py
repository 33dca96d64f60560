"""``python -m compass_compat server``: mlx-vlm's own server, patched, on 127.0.0.1.

- An OpenAI-style request with an image data URI and text gives the same greedy text as
  ``python -m compass_compat generate`` for the same checkpoint, image and prompt.
- Malformed image inputs get each pin's own answer, recorded below: every pin from 0.4.4
  to 0.7.10 answers 500 (the image fails to load inside generation, whose handlers map
  everything to 500), and the server keeps serving.
- Ctrl+C and SIGTERM end it with exit code 0.

Routes per pin (read from each pin's server code, checked here):
- 0.4.x: ``/v1/responses``. Its ``/v1/chat/completions`` calls mlx-lm's
  ``_infer_tool_parser(tokenizer.chat_template)``; mlx-lm >= 0.32 (what the pin resolves)
  takes the tokenizer there, so every chat completion fails with 500, whatever the model.
- 0.6 and later: ``/v1/chat/completions``.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

pytest.importorskip(
    "uvicorn", reason="mlx-vlm's server needs uvicorn and fastapi (installed with mlx-vlm on every pin)"
)

import compass_compat
from tests.support.cli_run import greedy_cli_output  # noqa: E402
from tests.support.server import MAX_TOKENS, VERSION, Server, data_uri, reply_text

# What each pin's own server answers for an image it cannot load.
MALFORMED_STATUS = {"0.4.4": 500, "0.6.12": 500, "0.7.10": 500}
PROMPT = "Describe the image."


@pytest.fixture(scope="module")
def image(fixture_images) -> Path:
    return fixture_images["synth_320x256.png"]


@pytest.fixture(scope="module")
def server(tiny_ckpt_original, tmp_path_factory):
    logs = tmp_path_factory.mktemp("server_logs")
    with Server(tiny_ckpt_original, logs / "server.log") as started:
        yield started


@pytest.fixture(scope="module")
def cli_text(tiny_ckpt_original, image) -> str:
    """What ``python -m compass_compat generate`` prints for the same checkpoint, image and prompt."""
    return greedy_cli_output(tiny_ckpt_original, PROMPT, MAX_TOKENS, image).rstrip("\n")


def good_request(image: Path) -> list:
    return [{"type": "image_url", "image_url": {"url": data_uri(image.read_bytes())}}, {"type": "text", "text": PROMPT}]


def test_server_gives_the_cli_greedy_text(server, cli_text, image):
    assert cli_text.strip()
    status, body = server.post(good_request(image))
    assert status == 200, f"{status} {body}\n{server.tail()}"
    assert reply_text(body).strip() == cli_text.strip()


def malformed(image: Path) -> dict:
    png = image.read_bytes()
    return {
        "bad base64": "data:image/png;base64,@@@ not base64 @@@",
        "not an image": data_uri(b"definitely not a picture"),
        "truncated image": data_uri(png[: len(png) // 3]),
        "missing file": "/nonexistent/compass-compat/pic.png",
    }


@pytest.mark.parametrize("case", ["bad base64", "not an image", "truncated image", "missing file"])
def test_malformed_image_gets_the_pins_status_and_the_server_keeps_serving(server, cli_text, image, case):
    url = malformed(image)[case]
    status, body = server.post([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}])
    expected = MALFORMED_STATUS.get(str(VERSION))
    if expected is None:  # a pin not recorded above: any error status, but say what it was
        assert status >= 400, f"mlx-vlm {VERSION} accepted a malformed image: {status} {body}"
    else:
        assert status == expected, f"mlx-vlm {VERSION} now answers {status} (recorded: {expected}): {body}"
    status, body = server.post(good_request(image))
    assert status == 200 and reply_text(body).strip() == cli_text.strip(), f"after {case}: {status} {body}"


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
