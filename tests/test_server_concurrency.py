"""mlx-vlm's own server under concurrent requests and its prefix cache.

From 0.6 its server decodes concurrent requests together (a BatchGenerator over batch
caches) and, with ``APC_ENABLED=1``, serves repeated prompt prefixes from its automatic
prefix cache. Each request here must return exactly the text that
``python -m compass_compat generate`` gives for it alone: mixed image and text requests of
different lengths, sent at once, then repeated (cache hits). Older pins serve one request at
a time; the same checks run there too.
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
import urllib.request
from pathlib import Path
from typing import Dict, List

import pytest

pytest.importorskip("uvicorn", reason="mlx-vlm's server needs uvicorn and fastapi (installed with mlx-vlm on every pin)")

from compass_compat import cli
from test_server import MAX_TOKENS, Server, data_uri, reply_text

# name -> (image fixture or None, prompt)
REQUESTS = {
    "image_a": ("synth_320x256.png", "Describe the image."),
    "image_b": ("synth_448x448.png", "What is in this picture? Answer in one short sentence please."),
    "text_short": (None, "Say hello."),
    "text_long": (None, "Tell me a long story about a lighthouse keeper who counts the boats in the bay."),
}


def content(name: str, images: Dict[str, Path]) -> list:
    image, prompt = REQUESTS[name]
    parts = [{"type": "text", "text": prompt}]
    if image:
        parts.insert(0, {"type": "image_url", "image_url": {"url": data_uri(images[image].read_bytes())}})
    return parts


@pytest.fixture(scope="module")
def alone(tiny_ckpt_original, fixture_images) -> Dict[str, str]:
    """Each request's text from the CLI, one at a time."""
    texts = {}
    for name, (image, prompt) in REQUESTS.items():
        args = ["generate", "--model", str(tiny_ckpt_original), "--prompt", prompt,
                "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--no-verbose"]
        args += ["--image", str(fixture_images[image])] if image else ["--no-image"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(args) == 0
        texts[name] = out.getvalue().rstrip("\n").strip()
        assert texts[name], name
    return texts


@pytest.fixture(scope="module")
def server(tiny_ckpt_original, tmp_path_factory):
    log = tmp_path_factory.mktemp("concurrency") / "server.log"
    # Prefix caching on, with blocks small enough for these short prompts (ignored before 0.6).
    s = Server(tiny_ckpt_original, log, env={"APC_ENABLED": "1", "APC_BLOCK_SIZE": "16"})
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def send_together(server: Server, names: List[str], images) -> Dict[str, tuple]:
    results: Dict[str, tuple] = {}
    barrier = threading.Barrier(len(names))

    def one(key: str, name: str):
        barrier.wait(timeout=60)
        results[key] = server.post(content(name, images))

    threads = [threading.Thread(target=one, args=(f"{i}:{n}", n)) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert len(results) == len(names), f"requests did not finish:\n{server.tail()}"
    return results


def check(results: Dict[str, tuple], alone: Dict[str, str], server: Server) -> None:
    for key, (status, body) in sorted(results.items()):
        name = key.split(":", 1)[1]
        assert status == 200, f"{key}: {status} {body}\n{server.tail()}"
        assert reply_text(body).strip() == alone[name], f"{key}: the text differs from the request alone"


def test_each_request_alone_gives_the_cli_text(server, alone, fixture_images):
    for name in REQUESTS:
        check({f"0:{name}": server.post(content(name, fixture_images))}, alone, server)


def test_concurrent_mixed_requests_each_give_their_own_text(server, alone, fixture_images):
    names = ["image_a", "text_long", "image_b", "text_short"]
    check(send_together(server, names, fixture_images), alone, server)


def test_the_same_requests_again_from_the_prefix_cache(server, alone, fixture_images):
    """Second and third time round: repeated prefixes (cache hits where the pin caches)."""
    for _ in range(2):
        check(send_together(server, ["text_long", "image_a", "image_a"], fixture_images), alone, server)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as r:
        health = json.loads(r.read())
    apc = health.get("apc") if isinstance(health, dict) else None
    if isinstance(apc, dict) and apc.get("enabled"):
        hits = {k: v for k, v in apc.items() if "hit" in k}
        assert any(isinstance(v, (int, float)) and v > 0 for v in hits.values()), f"no prefix-cache hits: {apc}"
