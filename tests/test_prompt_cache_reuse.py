"""Multi-turn prompt-cache reuse and the automatic prefix cache (APC): a turn that reuses a cache
gives the answer of the same whole conversation sent fresh, with no cache (greedy ids equal,
log-probabilities within 1e-4); the uncached answer is the one tests/test_caller_contract.py ties
to the recorded transformers reference.

Reuse is checked, not assumed: the ids the model was fed show whether the pin reused a prefix
(fewer than the whole prompt) or prefilled it all. Both features are probed, not read from
versions: ``mlx_vlm.PromptCacheState`` (0.4.4 and newer; ``python -m mlx_vlm.chat`` keeps one)
and ``mlx_vlm.apc.from_env`` (0.6 and newer; the server builds its manager with it when
``APC_ENABLED=1``). Pins that prime a trimmed prompt's positions (0.6+) reuse only a text-only
part after the prefix and prefill the rest whole; 0.4.4 trims a turn that adds a picture too and
passes the whole prompt's token types, grids and pixels unprimed, from which the model places it.

Ours runs on the default checkpoint (the toy: its sliding window covers these conversations,
so the pin's caches can be trimmed). mlx-vlm's own qwen3_vl on the same conversations:
docs/testing.md (the control model).
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import tempfile
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import numpy as np
import pytest

from compass_data import shapes, toy
from tests.support import contract, mlx_vlm_run
from tests.support.conversations import (
    CONVERSATIONS,
    Turn,
    check_turn,
    expected_reuse,
    prompt_cache_state_class,
    run_turn,
)
from tests.support.vendored import vendored

vendored()

PromptCacheState = prompt_cache_state_class()
pytestmark = pytest.mark.skipif(PromptCacheState is None, reason="this mlx-vlm has no PromptCacheState")

VERSION = importlib.metadata.version("mlx-vlm")
MAX_TOKENS = 12
DEMO = pathlib.Path(__file__).resolve().parents[1] / "compass_compat" / "assets" / "demo.png"


def apc_manager(monkeypatch):
    """A fresh automatic prefix cache, built as the server builds it with ``APC_ENABLED=1``."""
    try:
        from mlx_vlm import apc
    except ImportError:
        pytest.skip("this mlx-vlm has no automatic prefix cache (mlx_vlm.apc)")
    monkeypatch.setenv("APC_ENABLED", "1")
    monkeypatch.delenv("APC_DISK_PATH", raising=False)
    # A disk tier of its own: its blocks are keyed by tokens alone, and the tiny checkpoint and the
    # toy share a tokenizer (another checkpoint's blocks once broke a toy request here).
    monkeypatch.setenv("MLX_VLM_CACHE_HOME", tempfile.mkdtemp(prefix="apc-"))
    manager = apc.from_env()
    assert manager is not None
    return manager


def reuse_kwargs(kind: str, monkeypatch) -> Dict[str, Any]:
    return {"prompt_cache_state": PromptCacheState()} if kind == "state" else {"apc_manager": apc_manager(monkeypatch)}


# ----------------------------------------------------------------------------------- ours


@pytest.fixture(scope="module")
def loaded():
    return mlx_vlm_run.load(str(toy.ensure_default_checkpoint()))


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> Dict[str, str]:
    from PIL import Image

    scene = tmp_path_factory.mktemp("pictures") / "scene.png"
    Image.fromarray(shapes.render(shapes.random_scene(np.random.default_rng(3)))).save(scene)
    return {"demo": str(DEMO), "scene": str(scene)}


def user_turn(text: str, added: Tuple[str, ...]) -> Dict[str, Any]:
    """A user message: the text, after one image part per picture it adds."""
    content: Any = [{"type": "image"} for _ in added] + [{"type": "text", "text": text}] if added else text
    return {"role": "user", "content": content}


def ours(loaded, pictures, name: str, reuse: Dict[str, Any]) -> List[Tuple[Turn, Turn]]:
    """Each turn with the cache kept across turns and fresh; the conversation goes on with the
    uncached answer."""
    model, processor = loaded
    messages: List[Dict[str, Any]] = []
    images: List[str] = []
    out = []
    for text, added in CONVERSATIONS[name]:
        messages.append(user_turn(text, added))
        images += [pictures[p] for p in added]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        cached = run_turn(model, processor, prompt, MAX_TOKENS, image=list(images) or None, **reuse)
        fresh = run_turn(model, processor, prompt, MAX_TOKENS, image=list(images) or None)
        out.append((cached, fresh))
        answer = processor.tokenizer.decode(fresh.ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
    return out


# Measured: on 0.6.3 a request that extends an earlier one reuses its prefix and answers otherwise
# than uncached (the control given this model's cache layout did the same: docs/testing.md).
APC_FAILS = {"0.6.3": ("picture-text-picture", "text-only")}


def xfail_where_measured(request, table: Dict[str, Tuple[str, ...]], name: str) -> None:
    if name in table.get(VERSION, ()):
        request.applymarker(pytest.mark.xfail(reason=f"measured on mlx-vlm {VERSION}", strict=True))


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_multi_turn_prompt_cache_state_gives_the_uncached_answers(loaded, pictures, name, monkeypatch):
    """``stream_generate(..., prompt_cache_state=)`` as ``mlx_vlm.chat`` keeps it across turns."""
    for turn, (cached, fresh) in enumerate(ours(loaded, pictures, name, reuse_kwargs("state", monkeypatch))):
        check_turn(f"{name} turn {turn}", expected_reuse(name, turn), cached, fresh)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_automatic_prefix_cache_gives_the_uncached_answers(loaded, pictures, name, monkeypatch, request):
    """The server's cache (``APC_ENABLED=1``): one manager across the conversation's requests,
    each request sent twice. Measured on 0.6.x/0.7.x: the model's mixed caches take the
    manager's whole-prefix ("exact") mode; which requests reuse a prefix differs by pin (0.6.12: a
    repeated request; 0.6.3 and 0.7.10: also one that extends an earlier one). Every answer must
    be the uncached one, and at least one request of the conversation must reuse a prefix."""
    xfail_where_measured(request, APC_FAILS, name)
    reuse = reuse_kwargs("apc", monkeypatch)
    model, processor = loaded
    reused = 0
    messages: List[Dict[str, Any]] = []
    images: List[str] = []
    for turn, (text, added) in enumerate(CONVERSATIONS[name]):
        messages.append(user_turn(text, added))
        images += [pictures[p] for p in added]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        fresh = run_turn(model, processor, prompt, MAX_TOKENS, image=list(images) or None)
        first = run_turn(model, processor, prompt, MAX_TOKENS, image=list(images) or None, **reuse)
        again = run_turn(model, processor, prompt, MAX_TOKENS, image=list(images) or None, **reuse)
        check_turn(f"{name} turn {turn}", "either", first, fresh)
        check_turn(f"{name} turn {turn} repeated", "either", again, fresh)
        reused += (first.fed < fresh.fed) + (again.fed < fresh.fed)
        messages.append(
            {"role": "assistant", "content": processor.tokenizer.decode(fresh.ids, skip_special_tokens=True)}
        )
    assert reused, f"{name}: the automatic prefix cache reused no prefix in any request"


# ------------------------------------------------- the model's side, against the recorded reference
# How each pin hands the model the part of a prompt after a restored prefix, driven by hand on
# the tiny checkpoint and compared with transformers' recorded logits (tests/support/contract.py).


@pytest.fixture(scope="module")
def tiny(tiny_ckpt_original):
    from mlx_vlm.utils import load_model

    return load_model(tiny_ckpt_original)


@pytest.fixture(scope="module")
def cases(reference) -> Dict[str, contract.Case]:
    return {name: contract.reference_case(reference, name) for name in ("text_long", "img_448", "img_two")}


@pytest.mark.parametrize("name", ["img_448", "img_two"])
def test_text_suffix_with_its_own_zero_deltas_after_an_image_prefix(tiny, cases, name):
    """mlx-vlm 0.4.4's PromptCacheState: the suffix's own text embeddings (delta 0) merged into
    the language model's kwargs; the suffix continues the image prefix's delta."""
    case = cases[name]
    contract.item_restored(tiny, case, case.vision_end + 2, "embedded-alone")


def primed_positions_suffix(model, case: contract.Case, split: int) -> Tuple[List[Any], np.ndarray]:
    """mlx-vlm 0.7.x after a prefix-cache trim: the whole prompt's positions from
    ``get_rope_index`` and its delta passed with every chunk of the suffix."""
    cache = contract.make_cache(model)
    types = case.extra.get("mm_token_type_ids")
    extra = {**case.extra, "mm_token_type_ids": types[:, :split]} if types is not None else case.extra
    mx.eval(model(case.ids[:, :split], case.pixels, cache=cache, **extra).logits)
    positions, deltas = model.language_model.get_rope_index(case.ids, case.extra.get("image_grid_thw"), None, None)
    kwargs: Dict[str, Any] = {"position_ids": positions, "rope_deltas": deltas}
    suffix = case.ids[:, split:]
    emb = model.get_input_embeddings(suffix, None, **kwargs)
    kwargs.update({k: v for k, v in emb.to_dict().items() if v is not None and k != "inputs_embeds"})
    out = None
    for s in range(0, suffix.shape[1], contract.CHUNK):
        out = model.language_model(
            suffix[:, s : s + contract.CHUNK],
            inputs_embeds=emb.inputs_embeds[:, s : s + contract.CHUNK],
            cache=cache,
            **kwargs,
        )
    return cache, contract.last(out)


@pytest.mark.parametrize("name", ["text_long", "img_448", "img_two"])
def test_suffix_primed_with_the_whole_prompts_positions(tiny, cases, name):
    """The positions count from the prompt's first token, not from the suffix's first chunk."""
    case = cases[name]
    split = case.vision_end + 2 if case.has_image else case.length // 2
    cache, first = primed_positions_suffix(tiny, case, split)
    contract.check(case, contract.run_decode(tiny, cache, case, first, contract.decode_plain), "primed positions")


def test_whole_prompts_types_and_mask_with_the_suffix(tiny, cases):
    """mlx-vlm 0.6.x passes the whole prompt's ``mm_token_type_ids`` and mask with the suffix;
    types that do not mark the suffix's own image tokens are still refused."""
    fit = vendored("cohere_compass").fit_training_batch
    case = cases["img_448"]
    split = case.vision_end + 2
    types = np.asarray(case.extra["mm_token_type_ids"])
    mask = mx.ones((1, case.length), mx.int32)
    media = [tiny.config.image_token_id, tiny.config.video_token_id]
    _, _, got, got_mask, whole = fit(case.ids[:, split:], None, None, types, mask, media)
    assert got.shape == (1, case.length - split) and not got.any() and got_mask.shape == (1, case.length - split)
    assert whole.prefix == split and whole.types.shape == (1, case.length) and whole.mask.shape == (1, case.length)
    with pytest.raises(ValueError, match="columns but input_ids has"):
        fit(case.ids[:, 3:], None, None, types[:, ::-1], mask, media)  # the image columns misplaced


def vision_runs(case: contract.Case) -> List[Tuple[int, int]]:
    """(start, end) of each run of vision tokens of ``case``, in prompt order."""
    media = np.asarray(case.extra["mm_token_type_ids"])[0] != 0
    edges = np.flatnonzero(np.diff(np.concatenate([[0], media.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


# Where the prompt is cut: the cached prefix ends (vision runs by index; -1: before the vision-start token).
SPLITS = {
    "before-the-picture": ("img_448", lambda runs: runs[0][0] - 1),
    "in-the-picture": ("img_448", lambda runs: (runs[0][0] + runs[0][1]) // 2),
    "between-two-pictures": ("img_two", lambda runs: runs[1][0] - 1),
    "in-the-first-of-two": ("img_two", lambda runs: (runs[0][0] + runs[0][1]) // 2),
}


def restored_prefix(model, case: contract.Case, split: int) -> List[Any]:
    """A cache holding the prompt's first ``split`` tokens as the whole prompt's prefill leaves
    them (an earlier turn's): the whole prompt embedded, its first ``split`` columns fed."""
    cache = contract.make_cache(model)
    emb = model.get_input_embeddings(case.ids, case.pixels, **case.extra)
    deepstack = emb.deepstack_visual_embeds
    mx.eval(
        model.language_model(
            case.ids[:, :split],
            inputs_embeds=emb.inputs_embeds[:, :split],
            cache=cache,
            position_ids=emb.position_ids[..., :split],
            deepstack_visual_embeds=None if deepstack is None else deepstack[:, :split],
        ).logits
    )
    return cache


def suffix_as_0_4_4_generates(model, case: contract.Case, split: int, types: Any) -> Tuple[List[Any], np.ndarray]:
    """mlx-vlm 0.4.4's ``stream_generate`` with a ``PromptCacheState`` holding the prompt's first
    ``split`` tokens: the ids cut to the rest, passed to ``generate_step`` with every picture's
    pixels and grid, the prompt's mask and ``types`` as ``mm_token_type_ids``; no positions primed.
    ``generate_step`` embeds once, prefills in chunks (``prefill_step_size``; here
    :data:`contract.CHUNK`) with the embeddings' other outputs, then steps on the last token."""
    cache = restored_prefix(model, case, split)
    ids = case.ids[:, split:]
    kwargs: Dict[str, Any] = {"image_grid_thw": case.extra["image_grid_thw"], "mm_token_type_ids": types}
    mask = mx.ones((1, np.shape(types)[1]), mx.int32)
    emb = model.get_input_embeddings(ids, case.pixels, mask=mask, **kwargs)
    kwargs.update({k: v for k, v in emb.to_dict().items() if k != "inputs_embeds" and v is not None})
    embeds = emb.inputs_embeds
    while embeds.shape[1] > 1:
        n = min(contract.CHUNK, embeds.shape[1] - 1)
        model.language_model(inputs=ids[:, :n], inputs_embeds=embeds[:, :n], cache=cache, n_to_process=n, **kwargs)
        ids, embeds = ids[:, n:], embeds[:, n:]
    out = model.language_model(ids[:, -1:], inputs_embeds=embeds, cache=cache, **kwargs)
    return cache, contract.last(out)


@pytest.mark.parametrize("where", sorted(SPLITS))
def test_a_picture_after_a_restored_prefix_gives_the_references_logits(tiny, cases, where):
    """mlx-vlm 0.4.4's ``PromptCacheState`` with pictures after the cached prefix (its chat puts
    the picture in the follow-up message): the whole prompt's types and grids place the rest, and
    only the features of the vision tokens after the cut are used."""
    name, at = SPLITS[where]
    case = cases[name]
    split = at(vision_runs(case))
    cache, first = suffix_as_0_4_4_generates(tiny, case, split, case.extra["mm_token_type_ids"])
    contract.check(case, contract.run_decode(tiny, cache, case, first, contract.decode_plain), where)


def test_a_picture_after_a_restored_prefix_without_the_whole_prompts_types_is_refused(tiny, cases):
    """Types of the cut ids alone cannot place them after the cache: a named refusal."""
    case = cases["img_448"]
    split = vision_runs(case)[0][0] - 1
    types = np.asarray(case.extra["mm_token_type_ids"])[:, split:]
    with pytest.raises(ValueError, match="position_ids count from this prompt's first token"):
        suffix_as_0_4_4_generates(tiny, case, split, types)


def test_a_suffix_placed_after_a_prefix_of_another_length_is_refused(tiny, cases):
    """Positions placed after ``split`` cached tokens, fed to a cache holding one token fewer."""
    case = cases["img_448"]
    split = vision_runs(case)[0][0] - 1
    cache = restored_prefix(tiny, case, split - 1)
    suffix = case.ids[:, split:]
    emb = tiny.get_input_embeddings(suffix, case.pixels, **case.extra)
    kwargs = {k: v for k, v in emb.to_dict().items() if v is not None and k != "inputs_embeds"}
    with pytest.raises(ValueError, match=f"follow a cached prefix of {split} tokens"):
        tiny.language_model(suffix, inputs_embeds=emb.inputs_embeds, cache=cache, **kwargs)


def test_a_sliding_window_cache_cut_after_it_wrapped_is_refused(tiny, cases):
    """mlx-vlm 0.4.4's ``PromptCacheState`` cuts every cache by slicing its keys to the reused
    prefix (``generate.py`` ~690); a sliding-window ring that has wrapped then holds the last
    tokens, not the prefix. Served, the answer would be wrong: refused by name."""
    case = cases["text_long"]
    window = tiny.config.text_config.sliding_window
    assert case.length > window + 4, "the case must wrap the tiny checkpoint's window"
    cache = contract.make_cache(tiny)
    mx.eval(tiny(case.ids, cache=cache).logits)
    split = 4
    for c in cache:  # 0.4.4's cut, as it does it
        if c.keys.shape[2] > split:
            c.keys, c.values, c.offset = c.keys[:, :, :split], c.values[:, :, :split], split
    with pytest.raises(ValueError, match="The sliding-window cache was set back to 4 tokens"):
        tiny(case.ids[:, split:], cache=cache)


# ---------------------------------------------------------------------------------- the server


def test_server_with_the_automatic_prefix_cache_answers_as_without(tmp_path, pictures):
    """``APC_ENABLED=1`` against a server without it, same requests in the same order: a picture
    and a question, the same again, the conversation extended by a text turn; a text question,
    then the same conversation extended by a picture. Every reply the same; the cache was hit."""
    import importlib.util
    import json
    import urllib.request

    if importlib.util.find_spec("mlx_vlm.apc") is None:
        pytest.skip("this mlx-vlm has no automatic prefix cache (mlx_vlm.apc)")
    from tests.support.server import REQUEST_TIMEOUT, ROUTE, Server, data_uri, reply_text, serving

    if not ROUTE.endswith("/chat/completions"):
        pytest.skip(f"this mlx-vlm's server serves {ROUTE}; the conversations use chat completions")
    checkpoint = toy.ensure_default_checkpoint()
    servers = {
        enabled: Server(checkpoint, tmp_path / f"apc{enabled}.log", env={"APC_ENABLED": enabled})
        for enabled in ("1", "0")
    }
    picture = {"type": "image_url", "image_url": {"url": data_uri(pathlib.Path(pictures["demo"]).read_bytes())}}

    def ask(server: Server, messages: List[Dict[str, Any]]) -> str:
        body = dict(model=str(checkpoint), messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, stream=False)
        with urllib.request.urlopen(server.request(body), timeout=REQUEST_TIMEOUT) as reply:
            return reply_text(json.loads(reply.read()))

    def conversation(server: Server) -> List[str]:
        look = {"role": "user", "content": [picture, {"type": "text", "text": "Describe this image."}]}
        hello = {"role": "user", "content": "Hello there!"}
        answers = [ask(server, [look]), ask(server, [look])]
        extended = [look, {"role": "assistant", "content": answers[0]}, {"role": "user", "content": "How many shapes?"}]
        answers.append(ask(server, extended))
        answers.append(ask(server, [hello]))
        later = [hello, {"role": "assistant", "content": answers[-1]}, look]
        answers.append(ask(server, later))
        return answers

    with serving(servers):
        cached, plain = conversation(servers["1"]), conversation(servers["0"])
        with urllib.request.urlopen(f"http://127.0.0.1:{servers['1'].port}/v1/cache/stats", timeout=10) as r:
            apc = json.loads(r.read())
    assert cached == plain, (cached, plain)
    assert apc.get("enabled") is True, apc
    assert apc.get("exact_hits", 0) + apc.get("lookups_hit", 0) > 0, apc
