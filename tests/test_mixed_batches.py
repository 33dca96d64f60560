"""Batches through mlx-vlm's own server: every request answers as it does alone, whatever the
batch holds and wherever its prefill is cut (issue 43).

The server (0.6+) decodes concurrent requests together and prefills the requests that arrive
together as one left-padded batch, cut every ``--prefill-step-size`` columns (and, with its
automatic prefix cache on, at each row's checkpoint). The dimensions, crossed so that every pair
of values meets in at least one case (``CASES``):

- what the batch holds: text only, pictures only, text and pictures, text and a video;
- where a cut falls: none (one chunk), outside every picture (a chunk in which a picture row has
  none of its vision tokens), inside a picture;
- the prefix cache: off; on, with a row continuing a conversation whose first turn (a picture,
  or text only) was sent before.

Each case sends a picture request, waits until it decodes, then sends the batch's requests at
once. Every answer must equal that request's answer alone (the same server, one request at a
time, prefix cache off; tests/test_server_concurrency.py ties those to the CLI). The cut a case
names is observed, not assumed: the hosts' probe (scripts/hosts/common/probe, trace mode) logs
each ``LanguageModel`` call inside the server, and the case checks that the kind of chunk it
names went through the model. Measured before the fix (main a9dee8d): on 0.6.12 and 0.7.10 with
the vendored package live, every case that cuts outside a picture in a mixed batch answered
HTTP 500 (``position_ids has 2 rows but 0 of the batch's 3 rows have vision tokens``).
The full cross product and a randomized soak run in the scheduled job
(scripts/hosts/common/mixed_soak.py).
"""

from __future__ import annotations

import json
import pathlib
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import pytest

from scripts._lib.server import VERSION, Server, reply_text
from tests.lib.vendored import vendored

vendored()  # upstream 0.7.10's own cohere_compass fails mixed batches ([broadcast_shapes], measured)

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROBE = ROOT / "scripts" / "hosts" / "common" / "probe"
IMAGES = ROOT / "tests" / "fixtures" / "images"
CLIP = ROOT / "compass_compat" / "assets" / "demo_clip.avi"
STEP = 128  # --prefill-step-size: the tiny checkpoint's pictures take 80 and 196 tokens
MAX_TOKENS = 12
RUNNING_TOKENS = 60  # the request already decoding when a batch arrives


def _server_batches() -> bool:
    import importlib

    try:
        ar = importlib.import_module("mlx_vlm.generate.ar")
    except ImportError:
        return False
    # 0.6.3's batch generator cannot join [3, B, L] positions of different lengths (its own bug,
    # tests/test_server_concurrency.py); 0.6.12 joins them row by row.
    return hasattr(ar, "_is_mrope_position_ids_prompt_kwarg")


pytestmark = pytest.mark.skipif(
    not _server_batches(), reason=f"mlx-vlm {VERSION}'s server serves one request at a time (batching from 0.6.12)"
)


def _text(tokens: int, seed: str) -> str:
    """A text of ``tokens`` tokens of the tiny tokenizer (each case's texts start differently)."""
    from tokenizers import Tokenizer

    from compass_data.tiny import TOKENIZER_DIR

    tokenizer = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    words = [f"{seed}:"]
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False).ids) < tokens:
        words.append(f"{seed}{len(words) % 7}")
    return " ".join(words)


def _picture(name: str) -> dict:
    return {"type": "image_url", "image_url": {"url": str(IMAGES / name)}}


VIDEO = {"type": "video", "video": str(CLIP)}


@dataclass(frozen=True)
class Ask:
    """One request: its user turns' content parts (a follow-up names the turn it continues)."""

    parts: Tuple[str, ...]  # each part as JSON (hashable)
    after: Optional["Ask"] = None  # a conversation continuing this request (its answer as the reply)

    def content(self) -> list:
        return [json.loads(p) for p in self.parts]


def ask(*parts: dict, after: Optional[Ask] = None) -> Ask:
    return Ask(tuple(json.dumps(p, sort_keys=True) for p in parts), after)


def say(text: str) -> dict:
    return {"type": "text", "text": text}


SMALL, BIG = "synth_320x256.png", "synth_448x448.png"  # 80 and 196 vision tokens


def running(case: "Case") -> Ask:
    """The request already running when a case's batch arrives: its long prefill (about 2,000
    tokens, its own per case so no prefix cache shortens it) keeps the batch's rows waiting until
    all have arrived, so the server admits them as one prefill batch; it decodes while they prefill."""
    return ask(_picture("synth_640x480.png"), say(_text(2000, f"story{CASES.index(case)}")))


@dataclass(frozen=True)
class Case:
    holds: str  # text / pictures / mixed / video
    cut: str  # one-chunk / outside / inside
    prefix: str  # none / picture / text
    rows: Tuple[Ask, ...]
    warm: Tuple[Ask, ...] = ()  # sent alone first, on the prefix-cache server


def _cases() -> List[Case]:
    # Prompt tokens on the tiny checkpoint: a picture's own 80 (SMALL) or 196 (BIG), the video's
    # about 100, a turn's template about 10. A cut falls every STEP columns of the left-padded
    # batch, and with the prefix cache on also at each row's checkpoint (near its end). Every
    # case's texts and prefixes are its own, so the only prefix a case restores is its warm one.
    def pic_prefix(seed: str) -> Ask:
        return ask(_picture(SMALL), say(f"{seed}: what is in this picture?"))

    def text_prefix(seed: str) -> Ask:
        return ask(say(_text(60, seed)))

    def long_text(seed: str) -> dict:
        return say(_text(250, seed))

    def case(holds: str, cut: str, prefix: str, *rows: Ask, warm: Optional[Ask] = None) -> Case:
        return Case(holds, cut, prefix, rows, (warm,) if warm else ())

    p3, p5, p6, p7, p10, p11 = (
        pic_prefix("pa"),
        text_prefix("pb"),
        text_prefix("pc"),
        pic_prefix("pd"),
        text_prefix("pe"),
        pic_prefix("pf"),
    )
    return [
        case("text", "one-chunk", "none", ask(say("Say hello.")), ask(say(_text(80, "lamp")))),
        case(
            "text",
            "outside",
            "text",
            ask(say("Go on."), after=text_prefix("pg")),
            ask(long_text("tide")),
            ask(say("Say hi.")),
            warm=text_prefix("pg"),
        ),
        case(
            "pictures",
            "one-chunk",
            "picture",
            ask(say("And its colours?"), after=p3),
            ask(_picture(SMALL), say("Count the shapes.")),
            warm=p3,
        ),
        case(
            "pictures",
            "outside",
            "none",
            ask(_picture(SMALL), say(_text(70, "circle"))),
            ask(_picture("synth_256x320.png"), say(_text(70, "square"))),
        ),
        case(
            "pictures",
            "inside",
            "text",
            ask(_picture(BIG), say("Now this picture."), after=p5),
            ask(_picture(SMALL), say("Shapes?")),
            warm=p5,
        ),
        case(
            "mixed",
            "one-chunk",
            "text",
            ask(say("Go on."), after=p6),
            ask(_picture(SMALL), say("Colours?")),
            ask(say("Say hello.")),
            warm=p6,
        ),
        case(
            "mixed",
            "outside",
            "picture",
            ask(say("And its colours?"), after=p7),
            ask(long_text("wave")),
            ask(say("Hi.")),
            warm=p7,
        ),
        case(
            "mixed", "inside", "none", ask(_picture(BIG), say("Describe.")), ask(long_text("reef")), ask(say("Hello."))
        ),
        case("video", "one-chunk", "none", ask(VIDEO, say("What moves?")), ask(say("Say hello."))),
        case(
            "video",
            "outside",
            "text",
            ask(VIDEO, say("What moves here?")),
            ask(say("Go on."), after=p10),
            ask(long_text("gull")),
            warm=p10,
        ),
        case(
            "video",
            "inside",
            "picture",
            ask(VIDEO, say("What moves now?")),
            ask(_picture(BIG), say("And here?"), after=p11),
            warm=p11,
        ),
    ]


CASES = _cases()


def test_the_cases_cross_every_pair_of_dimensions():
    values = {
        "holds": {"text", "pictures", "mixed", "video"},
        "cut": {"one-chunk", "outside", "inside"},
        "prefix": {"none", "picture", "text"},
    }
    impossible = {("holds", "text", "cut", "inside"), ("holds", "text", "prefix", "picture")}
    seen = {(a, getattr(c, a), b, getattr(c, b)) for c in CASES for a in values for b in values if a < b}
    missing = {
        (a, x, b, y)
        for a in values
        for b in values
        if a < b
        for x in values[a]
        for y in values[b]
        if (a, x, b, y) not in seen and (a, x, b, y) not in impossible and (b, y, a, x) not in impossible
    }
    assert not missing


def _messages(request: Ask, answers: Dict[Ask, str]) -> list:
    turns: List[dict] = []
    if request.after is not None:
        turns = _messages(request.after, answers) + [{"role": "assistant", "content": answers[request.after]}]
    return turns + [{"role": "user", "content": request.content()}]


def _post(server: Server, messages: list, max_tokens: int) -> Tuple[int, dict]:
    import urllib.error
    import urllib.request

    body = {
        "model": server.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": False,
    }
    try:
        with urllib.request.urlopen(server.request(body), timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, {"raw": err.read().decode("utf-8", "replace")}


class Answers:
    """Each request's answer alone, asked once (a follow-up's prefix turn first)."""

    def __init__(self, server: Server):
        self.server, self.text = server, {}

    def messages(self, request: Ask) -> list:
        if request.after is not None:
            self.of(request.after)
        return _messages(request, self.text)

    def of(self, request: Ask, max_tokens: int = MAX_TOKENS) -> str:
        if request not in self.text:
            status, body = _post(self.server, self.messages(request), max_tokens)
            assert status == 200, (body, self.server.tail())
            self.text[request] = reply_text(body).strip()
        return self.text[request]


def _start(tmp: pathlib.Path, name: str, env: Dict[str, str]) -> Server:
    probe = tmp / f"probe-{name}"
    probe.mkdir()
    env = {**env, "COMPASS_HOST_PROBE_DIR": str(probe), "COMPASS_HOST_PROBE_TRACE": "1"}
    server = Server(CHECKPOINT[0], tmp / f"{name}.log", "--prefill-step-size", str(STEP), env=env, path=[str(PROBE)])
    server.probe = probe  # type: ignore[attr-defined]
    return server


CHECKPOINT: List[pathlib.Path] = []


@pytest.fixture(scope="module")
def servers(tiny_ckpt_original, tmp_path_factory):
    from scripts._lib.server import serving

    CHECKPOINT[:] = [tiny_ckpt_original]
    tmp = tmp_path_factory.mktemp("mixed_batches")
    started = {
        "plain": _start(tmp, "plain", {}),
        # Prefix caching on, blocks small enough for these prompts.
        "cached": _start(tmp, "cached", {"APC_ENABLED": "1", "APC_BLOCK_SIZE": "16"}),
    }
    with serving(started) as both:
        yield both


@pytest.fixture(scope="module")
def alone(servers) -> Answers:
    return Answers(servers["plain"])


def _trace(server: Server) -> List[dict]:
    lines: List[dict] = []
    for path in sorted(server.probe.glob("probe-*-lm.jsonl")):  # type: ignore[attr-defined]
        lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines


def _observed_cuts(calls: List[dict]) -> set:
    """The kinds of cut the model saw in prefills of several rows: "inside", a chunk that ends on
    a vision token with more chunks to come (mlx-vlm passes ``n_to_process`` to those); "outside",
    a chunk of a cut prefill in which a row with positions has none of its vision tokens, or a
    text-only prefill that was cut."""
    batches: Dict[int, List[dict]] = {}
    for call in calls:
        B, L = call["B_L"]
        if B > 1 and L > 1 and call["visual_tokens"] is not None:
            batches.setdefault(call["cache_id"], []).append(call)
    kinds = set()
    for chunks in batches.values():
        if len(chunks) < 2:
            continue
        for call in chunks:
            rows = call["position_rows"] or [False] * len(call["visual_tokens"])
            if "n_to_process" in call["kwargs"] and any(call["visual_last"]):
                kinds.add("inside")
            if any(r and t == 0 for r, t in zip(rows, call["visual_tokens"])) or not any(rows):
                kinds.add("outside")
    return kinds


def _send_together(server: Server, requests: Dict[str, Tuple[list, int]]) -> Dict[str, Tuple[int, dict]]:
    """The running request first; the others at once when its prefill has begun (they queue
    behind it, and the server admits them together as one prefill batch)."""
    results: Dict[str, Tuple[int, dict]] = {}

    def one(key: str, messages: list, max_tokens: int, barrier: Optional[threading.Barrier]) -> None:
        if barrier is not None:
            barrier.wait(timeout=60)
        results[key] = _post(server, messages, max_tokens)

    first = threading.Thread(target=one, args=("running", *requests.pop("running"), None))
    seen = len(_trace(server))
    first.start()
    deadline = time.monotonic() + 120
    while len(_trace(server)) == seen and time.monotonic() < deadline:
        time.sleep(0.01)
    barrier = threading.Barrier(len(requests))
    threads = [threading.Thread(target=one, args=(k, m, n, barrier)) for k, (m, n) in requests.items()]
    for t in threads:
        t.start()
    for t in threads + [first]:
        t.join(timeout=900)
    return results


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.holds}-{c.cut}-prefix_{c.prefix}")
def test_every_request_in_a_batch_answers_as_alone(servers, alone, case):
    server = servers["plain" if case.prefix == "none" else "cached"]
    for request in case.warm:  # the prefix the row continues is in the server's cache
        status, body = _post(server, alone.messages(request), MAX_TOKENS)
        assert status == 200 and reply_text(body).strip() == alone.of(request), (body, server.tail())
    first = running(case)
    want = {"running": alone.of(first, RUNNING_TOKENS)}
    want.update({f"row{i}": alone.of(r) for i, r in enumerate(case.rows)})
    before = len(_trace(server))
    sent = {"running": (alone.messages(first), RUNNING_TOKENS)}
    sent.update({f"row{i}": (alone.messages(r), MAX_TOKENS) for i, r in enumerate(case.rows)})
    results = _send_together(server, sent)
    calls = _trace(server)[before:]
    errors = [c["error"] for c in calls if "error" in c]
    got = {k: (s, reply_text(b).strip() if s == 200 else b) for k, (s, b) in results.items()}
    assert got == {k: (200, v) for k, v in want.items()}, (errors, server.tail(20))
    if case.cut != "one-chunk":
        prefills = [(c["B_L"], c["position_rows"], c["visual_tokens"]) for c in calls if c["B_L"][1] > 1]
        assert case.cut in _observed_cuts(calls), f"no {case.cut} cut went through the model: {prefills}"
    else:
        prefills = [(c["B_L"], c["position_rows"], c["visual_tokens"]) for c in calls if c["B_L"][1] > 1]
        assert not any(c["B_L"][0] > 1 and c["B_L"][1] == STEP for c in calls), f"the batch was cut: {prefills}"


def test_a_refused_request_fails_alone(servers, alone):
    """A request the processor refuses (a video placeholder typed as text, no video) is answered
    with its error while a request already decoding and one sent with it answer as alone: the
    refusal happens on the request's own thread, before it joins a batch."""
    server = servers["plain"]
    bad = ask(say("Look <|VIDEO_PAD|> here."))
    good = ask(_picture(SMALL), say("Which shapes?"))
    first = ask(_picture("synth_640x480.png"), say(_text(2000, "refusal")))
    want = {"running": alone.of(first, RUNNING_TOKENS), "good": alone.of(good)}
    sent = {
        "running": (alone.messages(first), RUNNING_TOKENS),
        "good": (alone.messages(good), MAX_TOKENS),
        "bad": (alone.messages(bad), MAX_TOKENS),
    }
    results = _send_together(server, sent)
    status, body = results.pop("bad")
    assert status != 200 and "VIDEO_PAD" in json.dumps(body), body
    assert {k: (s, reply_text(b).strip()) for k, (s, b) in results.items()} == {k: (200, v) for k, v in want.items()}
