"""mlx-vlm's own server with its vision-feature cache: a picture sent again runs no vision tower.

The server (on pins whose server hands ``vision_cache`` to the model) keys the cache by what the
request names: here a file path (0.6.x), or the processed pixels (0.7.x). The demo picture sent
three times, another picture once, then written over the first file: the demo turned 180 degrees
(same size, so the same grid: only its pixels tell it apart), then a picture of another size. The
tower must run once per distinct picture (four times for six picture requests), and every answer
must be ``python -m compass_compat generate``'s for that picture, the overwritten file's included
(never the stale features kept under its path). Tower runs and cache
gets are counted inside the server process by the hosts' probe (scripts/hosts/common/probe: it
wraps ``Model.encode_image`` and ``VisionFeatureCache.get`` / ``put``; the server is not touched).
Where the cache is not used (0.4.4's plain responses request, below) the same requests run the
tower 6 times: measured, and asserted there. Measured on 0.6.12 with throwaway changes to the
vendored model: ignoring ``vision_cache`` gives 6 tower runs (fails here, also on 0.7.10 forced);
serving a cached entry whose grid matches without checking its pixels answers the turned demo
with the demo's answer (fails here; 0.7.x keys by pixels, so such an entry never reaches it).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import time
from typing import Dict

import pytest
from PIL import Image

from compass_data import toy
from tests.support.cli_run import greedy_cli_output
from tests.support.server import MAX_TOKENS, Server, reply_text
from tests.support.server import VERSION as PIN
from tests.support.vendored import vendored

vendored()  # the server runs the live package: only ours is measured here

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROBE = ROOT / "scripts" / "hosts" / "common" / "probe"
DEMO = ROOT / "compass_compat" / "assets" / "demo.png"
IMAGES = ROOT / "tests" / "fixtures" / "images"
PROMPT = "Describe this picture."
# Measured: 0.4.4's server hands its cache to the model only in the streamed branch of /v1/responses
# (server.py, the stream_generate call in responses_endpoint); the plain request these tests send
# never reaches it, so every picture runs the tower (the pin's).
ROUTE_WITHOUT_CACHE = {"0.4.4"}


def _server_passes_vision_cache() -> bool:
    import mlx_vlm

    root = pathlib.Path(mlx_vlm.__file__).parent
    files = [root / "server.py"] if (root / "server.py").is_file() else sorted((root / "server").glob("*.py"))
    return any("vision_cache" in f.read_text(encoding="utf-8") for f in files)


pytestmark = pytest.mark.skipif(
    not _server_passes_vision_cache(), reason="this mlx-vlm's server has no vision-feature cache"
)


def _counts(probe_dir: pathlib.Path) -> Dict[str, object]:
    found = sorted(probe_dir.glob("probe-*-vision.json"))
    assert len(found) == 1, f"one server process expected to count vision work: {found}"
    return json.loads(found[0].read_text())


def _wait_for_probe(probe_dir: pathlib.Path, server: Server) -> None:
    """The probe wraps the methods once the server has imported the model: wait for its record."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        records = [json.loads(p.read_text()) for p in probe_dir.glob("probe-[0-9]*.json") if "-" not in p.stem[6:]]
        if any(r.get("live_file") for r in records):
            return
        time.sleep(0.5)
    pytest.fail(f"the probe never saw the model package live:\n{server.tail()}")


def test_a_picture_sent_again_runs_no_tower(tmp_path):
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    checkpoint = toy.ensure_default_checkpoint()
    picture = tmp_path / "picture.png"
    shutil.copyfile(DEMO, picture)
    other, third = IMAGES / "synth_448x448.png", IMAGES / "synth_320x256.png"
    turned = tmp_path / "turned.png"
    with Image.open(DEMO) as demo:
        demo.convert("RGB").rotate(180).save(turned)
    expected = {
        name: greedy_cli_output(checkpoint, PROMPT, MAX_TOKENS, path).strip()
        for name, path in (("demo", DEMO), ("other", other), ("turned", turned), ("third", third))
    }
    assert len(set(expected.values())) == 4, expected  # the pictures are told apart by their answers
    env = {"COMPASS_HOST_PROBE_DIR": str(probe_dir)}
    with Server(checkpoint, tmp_path / "server.log", env=env, path=[str(PROBE)]) as server:
        status, body = server.post([{"type": "text", "text": "Say hello."}])  # loads the model
        assert status == 200, (body, server.tail())
        _wait_for_probe(probe_dir, server)

        def ask(path: pathlib.Path) -> str:
            status, body = server.post(
                [{"type": "image_url", "image_url": {"url": str(path)}}, {"type": "text", "text": PROMPT}]
            )
            assert status == 200, (body, server.tail())
            return reply_text(body).strip()

        got = [ask(picture) for _ in range(3)] + [ask(other)]
        shutil.copyfile(turned, picture)  # same grid, other pixels, same key
        got.append(ask(picture))
        shutil.copyfile(third, picture)  # another grid under the same key
        got.append(ask(picture))
    assert got == [expected["demo"]] * 3 + [expected["other"], expected["turned"], expected["third"]]
    counts = _counts(probe_dir)
    if str(PIN) in ROUTE_WITHOUT_CACHE:
        assert (len(counts["tower_runs"]), counts["cache_get_hit"] + counts["cache_get_miss"]) == (6, 0), counts
        return
    assert len(counts["tower_runs"]) == 4, counts
    assert counts["cache_put"] == 4 and counts["cache_get_hit"] + counts["cache_get_miss"] == 6, counts
    # Keyed by path (0.6.x) both overwrites' gets return the entry stored under the path, which the
    # model refuses (its pixels differ): 4 hits, 2 misses; keyed by the processed pixels (0.7.x)
    # those gets miss: 2 and 4. Either way the tower ran for 4 of the 6 picture requests.
    assert counts["cache_get_hit"] in (2, 4), counts
