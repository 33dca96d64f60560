"""Batches of requests through mlx-vlm's own server, each answer checked against the same request
alone (issue 43): the requests, how a batch is sent, and what the server's model was given.

Used by tests/test_mixed_batches.py (a pairwise-crossed set of cases, in CI) and
scripts/hosts/common/mixed_soak.py (the full cross product and a randomized soak, scheduled).
A batch goes out behind a request with a long prefill (:func:`running`): the server queues the
batch's rows while it prefills and admits them together as one prefill batch. What each forward
of the model was given is read from the hosts' probe trace (scripts/hosts/common/probe, trace
mode), so a case's cut is observed, not assumed.
"""

from __future__ import annotations

import json
import pathlib
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

from tests.support.server import Server, reply_text

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROBE = ROOT / "scripts" / "hosts" / "common" / "probe"
IMAGES = ROOT / "tests" / "fixtures" / "images"
CLIP = ROOT / "compass_compat" / "assets" / "demo_clip.avi"
STEP = 128  # --prefill-step-size: the tiny checkpoint's pictures take 80 (SMALL) and 196 (BIG) tokens
SMALL, BIG, LARGE = "synth_320x256.png", "synth_448x448.png", "synth_640x480.png"
MAX_TOKENS = 12
RUNNING_TOKENS = 60  # the request already decoding when a batch arrives
HOLDS = ("text", "pictures", "mixed", "video")
CUTS = ("one-chunk", "outside", "inside")
PREFIXES = ("none", "picture", "text")


@lru_cache(maxsize=None)
def text(tokens: int, seed: str) -> str:
    """A text of ``tokens`` tokens of the tiny tokenizer, starting with ``seed``."""
    from tokenizers import Tokenizer

    from compass_data.tiny import TOKENIZER_DIR

    tokenizer = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    words = [f"{seed}:"]
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False).ids) < tokens:
        words.append(f"{seed}{len(words) % 7}")
    return " ".join(words)


def say(words: str) -> dict:
    return {"type": "text", "text": words}


def picture(name: str) -> dict:
    return {"type": "image_url", "image_url": {"url": str(IMAGES / name)}}


VIDEO = {"type": "video", "video": str(CLIP)}


@dataclass(frozen=True)
class Ask:
    """One request: its last user turn's content parts, and the request whose conversation it
    continues (that request's answer alone is the assistant turn between)."""

    parts: Tuple[str, ...]  # each part as JSON (hashable)
    after: Optional["Ask"] = None

    def content(self) -> list:
        return [json.loads(p) for p in self.parts]


def ask(*parts: dict, after: Optional[Ask] = None) -> Ask:
    return Ask(tuple(json.dumps(p, sort_keys=True) for p in parts), after)


def running(seed: str) -> Ask:
    """A request with a long prefill (about 2,000 tokens; its own ``seed`` so no prefix cache
    shortens it): a batch sent once it started waits for it, and it decodes while they prefill."""
    return ask(picture(LARGE), say(text(2000, seed)))


@dataclass(frozen=True)
class Case:
    holds: str  # HOLDS
    cut: str  # CUTS
    prefix: str  # PREFIXES
    rows: Tuple[Ask, ...]
    warm: Tuple[Ask, ...] = ()  # sent alone first, on the prefix-cache server

    @property
    def name(self) -> str:
        return f"{self.holds}-{self.cut}-prefix_{self.prefix}"


def post(server: Server, messages: list, max_tokens: int) -> Tuple[int, dict]:
    """(status, body) of one greedy, non-streaming chat request."""
    body = {"model": server.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    try:
        with urllib.request.urlopen(server.request(body), timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, {"raw": err.read().decode("utf-8", "replace")}


class Answers:
    """Each request's answer alone on ``server`` (one request at a time), asked once."""

    def __init__(self, server: Server):
        self.server, self.text = server, {}

    def messages(self, request: Ask) -> list:
        turns: List[dict] = []
        if request.after is not None:
            turns = self.messages(request.after) + [{"role": "assistant", "content": self.of(request.after)}]
        return turns + [{"role": "user", "content": request.content()}]

    def of(self, request: Ask, max_tokens: int = MAX_TOKENS) -> str:
        key = (request, max_tokens)
        if key not in self.text:
            status, body = post(self.server, self.messages(request), max_tokens)
            if status != 200:
                raise AssertionError(f"{status} {body}\n{self.server.tail()}")
            self.text[key] = reply_text(body).strip()
        return self.text[key]


def start(checkpoint: pathlib.Path, folder: pathlib.Path, name: str, env: Dict[str, str], step: int = STEP) -> Server:
    """A server at ``--prefill-step-size step`` with the hosts' probe tracing every model call."""
    probe = folder / f"probe-{name}"
    probe.mkdir(parents=True)
    env = {**env, "COMPASS_HOST_PROBE_DIR": str(probe), "COMPASS_HOST_PROBE_TRACE": "1"}
    server = Server(checkpoint, folder / f"{name}.log", "--prefill-step-size", str(step), env=env, path=[str(PROBE)])
    server.probe, server.step = probe, step  # type: ignore[attr-defined]
    return server


def trace(server: Server) -> List[dict]:
    """Every LanguageModel call the probe logged in the server so far."""
    lines: List[dict] = []
    for path in sorted(server.probe.glob("probe-*-lm.jsonl")):  # type: ignore[attr-defined]
        lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines


def observed_cuts(calls: List[dict], step: int = STEP) -> set:
    """The kinds of cut the model saw in prefills of several rows: "inside", a chunk that ends on
    a vision token with more chunks to come (mlx-vlm passes ``n_to_process`` to those); "outside",
    a chunk of a cut prefill in which a row with positions has none of its vision tokens, or a
    text-only prefill that was cut; "one-chunk", a prefill of several rows that ``--prefill-step-size``
    did not cut (the prefix cache's checkpoints may)."""
    batches: Dict[int, List[dict]] = {}
    for call in calls:
        B, L = call["B_L"]
        if B > 1 and L > 1 and call["visual_tokens"] is not None:
            batches.setdefault(call["cache_id"], []).append(call)
    kinds = set()
    for chunks in batches.values():
        if not any(c["B_L"][1] == step and "n_to_process" in c["kwargs"] for c in chunks):
            kinds.add("one-chunk")
        if len(chunks) < 2:
            continue
        for call in chunks:
            rows = call["position_rows"] or [False] * len(call["visual_tokens"])
            if "n_to_process" in call["kwargs"] and any(call["visual_last"]):
                kinds.add("inside")
            if any(r and t == 0 for r, t in zip(rows, call["visual_tokens"])) or not any(rows):
                kinds.add("outside")
    return kinds


def send_together(server: Server, requests: Dict[str, Tuple[list, int]]) -> Dict[str, Tuple[int, dict]]:
    """``requests["running"]`` first; the others at once when its prefill has begun (they queue
    behind it, and the server admits them together as one prefill batch)."""
    results: Dict[str, Tuple[int, dict]] = {}

    def one(key: str, messages: list, max_tokens: int, barrier: Optional[threading.Barrier]) -> None:
        if barrier is not None:
            barrier.wait(timeout=60)
        results[key] = post(server, messages, max_tokens)

    rest = dict(requests)
    first = threading.Thread(target=one, args=("running", *rest.pop("running"), None))
    seen = len(trace(server))
    first.start()
    deadline = time.monotonic() + 120
    while len(trace(server)) == seen and time.monotonic() < deadline:
        time.sleep(0.01)
    barrier = threading.Barrier(len(rest))
    threads = [threading.Thread(target=one, args=(k, m, n, barrier)) for k, (m, n) in rest.items()]
    for t in threads:
        t.start()
    for t in threads + [first]:
        t.join(timeout=900)
    return results


@dataclass
class Outcome:
    """One batch sent: what came back against what each request gives alone."""

    got: Dict[str, Tuple[int, str]]
    want: Dict[str, Tuple[int, str]]
    cuts: set
    step_cut: bool  # a prefill of several rows was cut at --prefill-step-size
    # a prefill chunk of one column in a batch of several rows (the prefix cache's checkpoints
    # make them): mlx-lm's BatchRotatingKVCache then attends wrongly for a row padded past the
    # window (tests/test_batching.py, strict xfail), whatever the model
    one_column_chunk: bool
    # a prefill of several rows, one of them restored from the prefix cache, cut into chunks: where
    # the pin samples such a row's first token from padding (tests/support/batch_server.py), the pin's
    restored_row_cut: bool
    errors: List[str]

    @property
    def as_alone(self) -> bool:
        return self.got == self.want


def run_batch(server: Server, alone: Answers, first: Ask, rows: Tuple[Ask, ...], warm: Tuple[Ask, ...] = ()) -> Outcome:
    """Warm ``server``'s prefix cache with ``warm``, then send ``rows`` behind ``first``."""
    for request in warm:
        status, body = post(server, alone.messages(request), MAX_TOKENS)
        if status != 200 or reply_text(body).strip() != alone.of(request):
            raise AssertionError(f"the warm-up request did not answer as alone: {status} {body}")
    want = {"running": (200, alone.of(first, RUNNING_TOKENS))}
    want.update({f"row{i}": (200, alone.of(r)) for i, r in enumerate(rows)})
    before = len(trace(server))
    sent = {"running": (alone.messages(first), RUNNING_TOKENS)}
    sent.update({f"row{i}": (alone.messages(r), MAX_TOKENS) for i, r in enumerate(rows)})
    results = send_together(server, sent)
    calls = trace(server)[before:]
    got = {k: (s, reply_text(b).strip() if s == 200 else json.dumps(b)[:300]) for k, (s, b) in results.items()}
    chunks = [c["B_L"][1] for c in calls if c["B_L"][0] > 1 and "n_to_process" in c["kwargs"]]
    starts = [c["offset"] for c in calls if c["B_L"][0] > 1 and "n_to_process" in c["kwargs"] and c["offset"]]
    restored = any(isinstance(o, list) and max(o) > 0 and min(o) >= 0 for o in starts)
    errors = [c["error"] for c in calls if "error" in c]
    step = getattr(server, "step", STEP)
    return Outcome(got, want, observed_cuts(calls, step), step in chunks, 1 in chunks, restored, errors)
