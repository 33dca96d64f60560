"""Batches through mlx-vlm's own server: every request answers as it does alone, whatever the
batch holds and wherever its prefill is cut (issue 43).

The server (0.6.12+) decodes concurrent requests together and prefills the requests that arrive
together as one left-padded batch, cut every ``--prefill-step-size`` columns (and, with its
automatic prefix cache on, at each row's checkpoint). The dimensions, crossed so that every pair
of values meets in at least one case (``CASES``; the full cross product and a randomized soak run
in the scheduled job, scripts/hosts/common/mixed_soak.py):

- what the batch holds: text only, pictures only, text and pictures, text and a video;
- where a cut falls: none (one chunk), outside every picture (a chunk in which a picture row has
  none of its vision tokens), inside a picture;
- the prefix cache: off; on, with a row continuing a conversation whose first turn (a picture,
  or text only) was sent before.

Each case sends a request with a long prefill, then the batch's requests at once while it
prefills (tests/support/mixed_batches.py). Every answer must equal that request's answer alone
(the same server, one request at a time, prefix cache off; tests/test_server_concurrency.py ties
those to the CLI). The cut a case names is observed in the server by the hosts' probe. Measured
before the fix (main a9dee8d): on 0.6.12 3 of the 11 cases (every batch with a picture row and a
chunk without its vision tokens) answered HTTP 500 for every request in flight (``position_ids
has 1 rows but 0 of the batch's 3 rows have vision tokens``).
"""

from __future__ import annotations

import json
from typing import List, Optional

import pytest

from tests.support.mixed_batches import (
    BIG,
    CUTS,
    HOLDS,
    MAX_TOKENS,
    PREFIXES,
    RUNNING_TOKENS,
    SMALL,
    VIDEO,
    Answers,
    Ask,
    Case,
    ask,
    picture,
    run_batch,
    running,
    say,
    send_together,
    start,
    text,
)
from tests.support.server import VERSION, reply_text, serving
from tests.support.vendored import vendored

vendored()  # upstream 0.7.10's own cohere_compass fails mixed batches ([broadcast_shapes], measured)


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


def _cases() -> List[Case]:
    # Prompt tokens on the tiny checkpoint: a picture's own 80 (SMALL) or 196 (BIG), the video's
    # about 100, a turn's template about 10. A cut falls every STEP (128) columns of the
    # left-padded batch, and with the prefix cache on also at each row's checkpoint (near its
    # end). Every case's texts and prefixes are its own, so the only prefix a case restores is
    # its warm one.
    def pic_prefix(seed: str) -> Ask:
        return ask(picture(SMALL), say(f"{seed}: what is in this picture?"))

    def text_prefix(seed: str) -> Ask:
        return ask(say(text(60, seed)))

    def long_text(seed: str) -> dict:
        return say(text(250, seed))

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
    p2 = text_prefix("pg")
    return [
        case("text", "one-chunk", "none", ask(say("Say hello.")), ask(say(text(80, "lamp")))),
        case("text", "outside", "text", ask(say("Go on."), after=p2), ask(long_text("tide")), ask(say("Hi.")), warm=p2),
        case(
            "pictures",
            "one-chunk",
            "picture",
            ask(say("And its colours?"), after=p3),
            ask(picture(SMALL), say("Count the shapes.")),
            warm=p3,
        ),
        case(
            "pictures",
            "outside",
            "none",
            ask(picture(SMALL), say(text(70, "circle"))),
            ask(picture("synth_256x320.png"), say(text(70, "square"))),
        ),
        case(
            "pictures",
            "inside",
            "text",
            ask(picture(BIG), say("Now this picture."), after=p5),
            ask(picture(SMALL), say("Shapes?")),
            warm=p5,
        ),
        case(
            "mixed",
            "one-chunk",
            "text",
            ask(say("Go on."), after=p6),
            ask(picture(SMALL), say("Colours?")),
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
            "mixed", "inside", "none", ask(picture(BIG), say("Describe.")), ask(long_text("reef")), ask(say("Hello."))
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
            ask(picture(BIG), say("And here?"), after=p11),
            warm=p11,
        ),
    ]


CASES = _cases()
# Pairs no batch can hold: a text-only batch has no picture to cut inside or to restore.
IMPOSSIBLE = {("cut", "inside", "holds", "text"), ("holds", "text", "prefix", "picture")}


def test_the_cases_cross_every_pair_of_dimensions():
    values = {"holds": set(HOLDS), "cut": set(CUTS), "prefix": set(PREFIXES)}
    seen = {(a, getattr(c, a), b, getattr(c, b)) for c in CASES for a in values for b in values if a < b}
    wanted = {(a, x, b, y) for a in values for b in values if a < b for x in values[a] for y in values[b]}
    assert wanted - seen == IMPOSSIBLE


@pytest.fixture(scope="module")
def servers(tiny_ckpt_original, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixed_batches")
    started = {
        "plain": start(tiny_ckpt_original, folder, "plain", {}),
        # Prefix caching on, blocks small enough for these prompts.
        "cached": start(tiny_ckpt_original, folder, "cached", {"APC_ENABLED": "1", "APC_BLOCK_SIZE": "16"}),
    }
    with serving(started) as both:
        yield both


@pytest.fixture(scope="module")
def alone(servers) -> Answers:
    return Answers(servers["plain"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_request_in_a_batch_answers_as_alone(servers, alone, case):
    server = servers["plain" if case.prefix == "none" else "cached"]
    outcome = run_batch(server, alone, running(f"story{CASES.index(case)}"), case.rows, case.warm)
    assert outcome.got == outcome.want, (outcome.errors, server.tail(20))
    if case.cut == "one-chunk":
        assert not outcome.step_cut, "the batch's prefill was cut at --prefill-step-size"
    else:
        assert case.cut in outcome.cuts, f"no {case.cut} cut went through the model: {outcome.cuts}"


def test_a_refused_request_fails_alone(servers, alone):
    """A request the processor refuses (a video placeholder typed as text, no video) is answered
    with its error while a request already decoding and one sent with it answer as alone: the
    refusal happens on the request's own thread, before it joins a batch."""
    server = servers["plain"]
    bad, good, first = ask(say("Look <|VIDEO_PAD|> here.")), ask(picture(SMALL), say("Which shapes?")), running("no")
    want = {"running": alone.of(first, RUNNING_TOKENS), "good": alone.of(good)}
    sent = {
        "running": (alone.messages(first), RUNNING_TOKENS),
        "good": (alone.messages(good), MAX_TOKENS),
        "bad": (alone.messages(bad), MAX_TOKENS),
    }
    results = send_together(server, sent)
    status, body = results.pop("bad")
    assert status != 200 and "VIDEO_PAD" in json.dumps(body), body
    assert {k: (s, reply_text(b).strip()) for k, (s, b) in results.items()} == {k: (200, v) for k, v in want.items()}


# Identical requests (issue 44): a picture request already decoding when the same request
# arrives with another. With the prefix cache on, the repeated request restores the first one's
# prefix and is prefilled beside a cold row; mlx-vlm 0.6.12 then samples its first token from a
# padding column (the pin's: tests/support/batch_server.py pin_samples_a_padding_column, measured
# with a model-free echo model; 0.7.x fixed it). Through the server on pins where it holds,
# and in process, with the pin's own admission, on every batching pin (a strict xfail where the
# pin samples padding).
TWICE = ask(picture(SMALL), picture("synth_256x320.png"), say("Describe these pictures."))
OTHER = ask(picture("synth_256x320.png"), say("Where is the blue square?"))


@pytest.fixture(scope="module")
def pin_samples_padding() -> bool:
    from tests.support.batch_server import pin_samples_a_padding_column

    return pin_samples_a_padding_column()


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["prefix_cache_off", "prefix_cache_on"])
def test_identical_requests_through_the_server_answer_as_alone(servers, alone, prefix_cache, pin_samples_padding):
    if prefix_cache and pin_samples_padding:
        pytest.skip(
            f"mlx-vlm {VERSION} samples a restored row's first token from padding (the pin's; in-process test below)"
        )
    server = servers["cached" if prefix_cache else "plain"]
    outcome = run_batch(server, alone, TWICE, (OTHER, TWICE))  # sent first, and again in the batch
    assert outcome.got == outcome.want, (outcome.errors, server.tail(20))


@pytest.fixture(scope="module")
def loaded(tiny_ckpt_original):
    import mlx_vlm

    return mlx_vlm.load(str(tiny_ckpt_original))


def _inputs(loaded, request: Ask, tag: int):
    """The processor's arrays for a one-turn request, as the server's preprocessing gives them."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs

    model, processor = loaded
    parts = request.content()
    images = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    question = " ".join(p["text"] for p in parts if p["type"] == "text")
    prompt = apply_chat_template(processor, model.config, question, num_images=len(images))
    arrays = dict(
        prepare_inputs(processor, images=images, prompts=prompt, image_token_index=model.config.image_token_id)
    )
    out = {"input_ids": arrays.pop("input_ids"), "pixel_values": arrays.pop("pixel_values"), "image_hash": tag}
    out["mask"] = arrays.pop("attention_mask")
    return {**out, **arrays}


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["prefix_cache_off", "prefix_cache_on"])
def test_identical_requests_in_the_pins_admission_answer_as_alone(loaded, prefix_cache, pin_samples_padding, request):
    from tests.support.batch_server import serve

    if prefix_cache and pin_samples_padding:
        request.applymarker(
            pytest.mark.xfail(
                strict=True, reason=f"mlx-vlm {VERSION} samples the restored row's first token from padding"
            )
        )
    model, _ = loaded
    eos = model.config.eos_token_id
    eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    twice, other = _inputs(loaded, TWICE, 1), _inputs(loaded, OTHER, 2)
    alone = [serve(model, eos, r, [], MAX_TOKENS, apc=False)[0] for r in (twice, other)]
    got = serve(model, eos, twice, [other, twice], MAX_TOKENS, apc=prefix_cache, prefill_step_size=32)
    assert got == [alone[0], alone[1], alone[0]]
