"""The control on the installed mlx-vlm, a survey: which items mlx-vlm's own ``qwen3_vl`` (a tiny
random checkpoint, scripts/_lib/control.py) passes. First the control itself (built deterministically,
loaded exactly, its cases' shapes, pixels reaching the logits, its greedy paths agreeing, its image
positions by Qwen3-VL's rule) and the pin's own qwen3_vl defects (an item per defect, failing where
the pin has it); then the caller contract, driven by exactly the calls tests/test_caller_contract.py
makes on ours (scripts/_lib/contract.py) and compared with its own one-shot forward pass; the pin's
server routes and embedding call; its generation features as the suite drives them on ours
(prompt-cache reuse, the automatic prefix cache, logits processors, speculative decoding, the chat
CLI); and its conversion recipes.

    python -m scripts.pin_bump.control_survey [--json OUT]     (in a pin's environment; pin_bump.sh runs it)

It monitors mlx-vlm, not this project: where the control fails an item, the pin's own model (or the
host convention the item stands for) is at fault and ours is made right anyway. The failures
measured per release are recorded in scripts/pin_bump/control_expected.json; an item that starts
to pass, or a new failure, tells the maintainer a convention changed (docs/model-contract.md).
Prints one line per item and a summary; exit 0 when the failures are the recorded ones, 1 when they
differ or the release has no record.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

import numpy as np

EXPECTED = Path(__file__).resolve().parent / "control_expected.json"
ALL = ["text_short", "text_long", "image", "two_images"]
TEXT = ["text_short", "text_long"]
STEPS = 6
TEXT_PROMPT = "Hello there"
CONTROL_TIMEOUT = 15  # seconds; the control's zero-token prompt fails at once, or never answers


# --------------------------------------------------------------------------- the control itself
def builds_are_byte_identical_and_a_rebuild_writes_nothing(folder: Path) -> None:
    from scripts._lib import control

    again = control.build_control(folder.parent / "again")
    for name in control.FILES:
        assert (again / name).read_bytes() == (folder / name).read_bytes(), name
    record = json.loads((again / control.FINGERPRINT_FILE).read_text())
    assert record["weights_sha256"] == control.weights_sha256(control.control_weights(0))
    stamps = {name: (again / name).stat().st_mtime_ns for name in control.FILES}
    control.build_control(again)
    assert {name: (again / name).stat().st_mtime_ns for name in control.FILES} == stamps
    # A damaged file is rewritten; another seed gives other weights.
    (again / "model.safetensors").write_bytes(b"\0" * 16)
    control.build_control(again)
    assert (again / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    other = control.build_control(folder.parent / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (folder / "model.safetensors").read_bytes()


def loads_exactly_the_built_weights(model) -> None:
    from mlx.utils import tree_flatten

    from scripts._lib import control

    assert type(model).__module__ == "mlx_vlm.models.qwen3_vl.qwen3_vl"
    built = control.control_weights(0)
    loaded = dict(tree_flatten(model.parameters()))
    assert len(loaded) == len(built)
    for key, value in built.items():
        for hf, mlx in (("model.language_model.", "language_model.model."), ("model.visual.", "vision_tower.")):
            if key.startswith(hf):
                key = mlx + key[len(hf) :]
        if key.startswith("lm_head."):
            key = "language_model." + key
        if key.endswith("patch_embed.proj.weight"):  # torch [O, C, T, P, P] -> MLX [O, T, P, P, C]
            value = value.transpose(0, 2, 3, 4, 1)
        np.testing.assert_array_equal(np.array(loaded[key]), value, err_msg=key)


def case_shapes_and_finite_logits(model, case: str) -> None:
    from scripts._lib import control

    inputs = control.control_prompt(case)
    runs, grids = control.CASES[case]
    ids = np.array(inputs["input_ids"])[0]
    tokens = [control.image_token_count(g) for g in grids]
    assert ids.shape == (sum(runs) + sum(tokens) + 2 * len(grids),)
    assert int((ids == control.IMAGE_ID).sum()) == sum(tokens)
    assert int((ids == control.VISION_START_ID).sum()) == int((ids == control.VISION_END_ID).sum()) == len(grids)
    if grids:
        assert inputs["pixel_values"].shape == (sum(t * h * w for t, h, w in grids), control.PATCH_DIM)
        assert np.array(inputs["image_grid_thw"]).tolist() == [list(g) for g in grids]
    logits = control.one_shot_logits(model, inputs)
    assert logits.shape == (ids.size, control.VOCAB_SIZE)
    assert np.isfinite(logits).all()
    # Same case, same inputs: the same logits bit for bit.
    np.testing.assert_array_equal(control.one_shot_logits(model, control.control_prompt(case)), logits)


def pixels_reach_the_logits_only_after_the_first_image(model, case: str) -> None:
    from scripts._lib import control

    inputs = control.control_prompt(case)
    first = int(np.argmax(np.array(inputs["input_ids"])[0] == control.IMAGE_ID))
    base = control.one_shot_logits(model, inputs)
    other = control.one_shot_logits(model, control.control_prompt(case, pixel_seed=7))
    # Causal: the text before the first image token cannot see the pixels.
    np.testing.assert_allclose(other[:first], base[:first], rtol=0, atol=1e-6)
    assert (np.abs(other[first:] - base[first:]).max(axis=-1) > 1e-3).all()
    assert np.abs(other[-1] - base[-1]).max() > 0.1


def a_picture_patchifies_into_the_grid_it_names(model) -> None:
    from scripts._lib import control

    picture = np.random.default_rng(3).integers(0, 256, size=(64, 96, 3), dtype=np.uint8)
    rows, grid = control.patchify(picture)
    assert grid == control.CASES["image"][1][0] == (1, 4, 6)

    def normalized(block: np.ndarray) -> np.ndarray:
        return (block.transpose(2, 0, 1).astype(np.float32) / 255.0 - 0.5) / 0.5

    # Row 1 is the second patch of the first merge block: picture rows 0-15, columns 16-31.
    patch = rows[1].reshape(3, 2, 16, 16)
    np.testing.assert_allclose(patch[:, 0], normalized(picture[0:16, 16:32]), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(patch[:, 0], patch[:, 1])
    # Row 2 starts the merge block's second row: picture rows 16-31, columns 0-15.
    np.testing.assert_allclose(rows[2].reshape(3, 2, 16, 16)[:, 0], normalized(picture[16:32, 0:16]), rtol=0, atol=1e-6)
    assert np.isfinite(control.one_shot_logits(model, control.control_prompt("image", pixel_values=rows))).all()


def greedy_paths_agree(model, case: str) -> None:
    from scripts._lib import control

    inputs = control.control_prompt(case)
    reference = control.recompute_greedy(model, inputs, STEPS)
    assert reference[0] == int(np.argmax(control.one_shot_logits(model, inputs)[-1]))
    assert control.one_shot_greedy(model, inputs, STEPS) == reference
    assert control.pin_greedy(model, inputs, STEPS) == reference


def positions_of_one_image_follow_the_rule(model) -> None:
    import mlx.core as mx

    from scripts._lib import control

    inputs = control.control_prompt("image")
    control.fresh_state(model)
    lm = model.language_model
    positions, delta = lm.get_rope_index(inputs["input_ids"], inputs["image_grid_thw"], None, inputs["mask"])
    expected = control.expected_positions(inputs)
    np.testing.assert_array_equal(np.array(positions)[:, 0, :], expected)
    assert int(mx.array(delta).reshape(-1)[0].item()) == expected.max() + 1 - expected.shape[1]


# --------------------------------------------------------------------------- the pins' own qwen3_vl defects
def no_rope_index_one_image(model) -> None:
    from scripts._lib import control

    two = control.control_prompt("two_images")
    control.fresh_state(model)
    positions, _ = model.language_model.get_rope_index(two["input_ids"], two["image_grid_thw"], None, two["mask"])
    assert np.array_equal(np.array(positions)[:, 0, :], control.expected_positions(two)), (
        "get_rope_index finds the vision-start token by summing the indices of all of them, so in a "
        "prompt with two or more images at most one image gets grid positions"
    )


def no_deepstack_dropped(model) -> None:
    from scripts._lib import control

    image = control.control_prompt("image")
    with_deepstack = control.one_shot_logits(model, image)
    indexes = model.vision_tower.deepstack_visual_indexes
    model.vision_tower.deepstack_visual_indexes = []
    try:
        without = control.one_shot_logits(model, image)
    finally:
        model.vision_tower.deepstack_visual_indexes = indexes
    assert not np.array_equal(with_deepstack, without), (
        "get_input_embeddings keeps mx.eval()'s return value (None) as the deepstack features, so "
        "they never reach the decoder"
    )


def no_chunked_call_restarts_positions(model, chunk: int = 32) -> None:
    import mlx.core as mx
    from mlx_vlm.models.cache import make_prompt_cache

    from scripts._lib import control

    text = control.control_prompt("text_long")
    whole = control.one_shot_logits(model, text)
    control.fresh_state(model)
    cache = make_prompt_cache(model.language_model)
    ids = text["input_ids"]
    rows = [
        np.array(getattr(out, "logits", out)[0].astype(mx.float32))
        for out in (model(ids[:, a : a + chunk], cache=cache, pixel_values=None) for a in range(0, ids.shape[1], chunk))
    ]
    assert np.allclose(np.concatenate(rows), whole, atol=1e-4, rtol=0), (
        "model(chunk, cache=cache) with a text chunk takes positions from the chunk alone (from 0), "
        "not from the cache offset"
    )


# --------------------------------------------------------------------------- the pin's server and embedding call
def embedding_call_gives_no_text_embeds(folder: Path) -> None:
    """The pin's embedding loader and call on a generative VLM: no ``text_embeds`` (what /v1/embeddings refuses on)."""
    import mlx.core as mx
    from mlx_vlm.embedding_loader import load_embedding_model

    model = load_embedding_model(folder)
    ids = mx.array([[5, 6, 7, 8]], dtype=mx.int32)
    out = model(ids, attention_mask=mx.ones(ids.shape, dtype=mx.int32))
    assert getattr(out, "logits", out).shape[:2] == (1, 4)  # it ran: a generation output, one row per token
    assert getattr(out, "text_embeds", None) is None


def _answer_text(raw: bytes) -> str:
    """The text of a messages or responses reply ("" when it holds none)."""
    from scripts._lib.server import reply_text

    try:
        body = json.loads(raw)
        if body.get("type") == "message":
            return "".join(part["text"] for part in body["content"] if part["type"] == "text")
        return reply_text(body)
    except (KeyError, ValueError, TypeError, AttributeError):
        return ""


def routes_cannot_ask_the_control(server, name: str) -> None:
    """The control has no processor files: its server exits at startup (0.3.x), or starts with a
    processor of no vocabulary and the request fails in the pin (an error status, an error in place
    of the text, or no answer at all: 0.6.12's request waits forever once its generation thread has
    failed), never an answer to compare. A pin without the route has nothing to ask."""
    from scripts._lib.server import ROUTE_PATHS, has_route, messages_body, responses_body, send

    if not server.came_up():
        assert "Can't load image processor" in server.tail(400), server.tail()
        return
    routes = [route for route in ROUTE_PATHS[name] if has_route(server, route)]
    if not routes:
        return
    build = messages_body if name == "messages" else responses_body
    try:
        status, raw = send(server, routes[0], build(server.model, TEXT_PROMPT), timeout=CONTROL_TIMEOUT)
    except TimeoutError:
        status, raw = 0, b""
    text = _answer_text(raw) if status == 200 else ""
    assert not text.strip(), f"the control answered {text!r}: it has a tokenizer now; compare it"
    log = server.tail(400)
    assert "prompt_tokens=0" in log or "size 0" in log or status >= 400, log


def server_items(folder: Path, server) -> List[Tuple[str, Callable[[], None]]]:
    """(item id, its check) for the pin's server routes and embedding call on the control, where the pin has them."""
    from scripts._lib.server import ROUTE_PATHS

    out: List[Tuple[str, Callable[[], None]]] = []
    if importlib.util.find_spec("mlx_vlm.embedding_loader") is not None:
        out.append(("embedding_call_gives_no_text_embeds", lambda: embedding_call_gives_no_text_embeds(folder)))
    if server is not None:
        for name in sorted(ROUTE_PATHS):
            out.append(
                (f"routes_cannot_ask_the_control[{name}]", lambda n=name: routes_cannot_ask_the_control(server, n))
            )
    return out


# --------------------------------------------------------------------------- the pin's generation features
# The conversations of tests/test_prompt_cache_reuse.py in the control's ids: each picture a block
# of the grid below, each turn CONTROL_TEXT seeded text ids.
CONTROL_GRIDS = {"demo": (1, 4, 6), "scene": (1, 6, 4)}
CONTROL_TEXT = 20  # text ids per turn: the pins store the control's cache in blocks of 16
MAX_TOKENS = 12
DEMO = Path(__file__).resolve().parents[2] / "compass_compat" / "assets" / "demo.png"
NO_METAL = "[metal_kernel] No Metal back-end"


def control_turn(model, ids: List[int], pictures: List[str], **reuse):
    """One greedy ``stream_generate`` request of the control on ``ids``; without ``reuse``, on a
    freshly reset model."""
    import mlx.core as mx

    from scripts._lib import control
    from scripts._lib.conversations import IdsOnly, run_turn

    kwargs = dict(input_ids=mx.array([ids], dtype=mx.int32), mask=mx.ones((1, len(ids)), mx.int32))
    if pictures:
        grids = [CONTROL_GRIDS[p] for p in pictures]
        rows = [control.random_pixels([CONTROL_GRIDS[p]], seed=i) for i, p in enumerate(pictures)]
        kwargs.update(pixel_values=mx.array(np.concatenate(rows)), image_grid_thw=mx.array(grids, dtype=mx.int32))
    if not reuse:
        control.fresh_state(model)
    return run_turn(model, IdsOnly(control.EOS_ID), "", MAX_TOKENS, **kwargs, **reuse)


def control_conversation(model, name: str, reuse: dict, sends: int = 1) -> list:
    """Conversation ``name``: each turn its text ids (seeded) and its pictures' blocks; the next
    turn follows the uncached answer (up to its first special id). Each turn: the uncached run,
    then ``sends`` runs with ``reuse``."""
    from scripts._lib import control
    from scripts._lib.conversations import CONVERSATIONS

    rng = np.random.default_rng(7)
    ids: List[int] = []
    pictures: List[str] = []
    out = []
    for _, added in CONVERSATIONS[name]:
        for picture in added:
            ids += [control.VISION_START_ID] + [control.IMAGE_ID] * control.image_token_count(CONTROL_GRIDS[picture])
            ids += [control.VISION_END_ID]
        pictures += added
        ids += rng.integers(1, control.TEXT_ID_LIMIT, size=CONTROL_TEXT).tolist()
        runs = [control_turn(model, ids, pictures, **reuse) for _ in range(sends)]
        fresh = control_turn(model, ids, pictures)
        out.append((fresh, *runs))
        special = [i for i, t in enumerate(fresh.ids) if t >= control.TEXT_ID_LIMIT]
        ids += fresh.ids[: special[0]] if special else fresh.ids
    return out


def prompt_cache_state_gives_the_uncached_answers(model, name: str) -> None:
    """``stream_generate(..., prompt_cache_state=)`` as ``mlx_vlm.chat`` keeps it across turns."""
    from scripts._lib.conversations import check_turn, expected_reuse, prompt_cache_state_class

    turns = control_conversation(model, name, {"prompt_cache_state": prompt_cache_state_class()()})
    for turn, (fresh, cached) in enumerate(turns):
        check_turn(f"{name} turn {turn}", expected_reuse(name, turn), cached, fresh)


@contextlib.contextmanager
def apc_environment() -> Iterator[None]:
    """The server's ``APC_ENABLED=1``, with a disk tier of its own (its blocks are keyed by tokens alone)."""
    keys = ("APC_ENABLED", "APC_DISK_PATH", "MLX_VLM_CACHE_HOME")
    saved = {key: os.environ.get(key) for key in keys}
    os.environ.update(APC_ENABLED="1", MLX_VLM_CACHE_HOME=tempfile.mkdtemp(prefix="apc-"))
    os.environ.pop("APC_DISK_PATH", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def mixed_layout(model) -> list:
    """Our model's cache layout on the control: rotating caches (window past these conversations)
    then one full cache, so the pin's APC takes the same (whole-prefix) mode."""
    from mlx_vlm.models.cache import KVCache, RotatingKVCache

    layers = len(model.language_model.layers)
    return [RotatingKVCache(max_size=4096, keep=0) for _ in range(layers - 1)] + [KVCache()]


def apc_items(folder: Path) -> List[Tuple[str, Callable[[], None]]]:
    """(item id, its check) for the automatic prefix cache: each conversation's requests sent twice
    to one manager, in the control's own cache layout (the manager's block mode) and in ours
    (whole-prefix mode): every answer the uncached one; and a prefix reused at least once."""
    from mlx_vlm import apc

    from scripts._lib.control import load_control
    from scripts._lib.conversations import CONVERSATIONS, check_turn

    @functools.lru_cache(maxsize=None)
    def conversation(layout: str, name: str) -> list:
        model = load_control(folder)
        if layout == "mixed":
            model.language_model.make_cache = lambda: mixed_layout(model)
        with apc_environment():
            return control_conversation(model, name, {"apc_manager": apc.from_env()}, sends=2)

    def answers(layout: str, name: str) -> None:
        for turn, (fresh, first, again) in enumerate(conversation(layout, name)):
            check_turn(f"{layout}-{name} turn {turn}", "either", first, fresh)
            check_turn(f"{layout}-{name} turn {turn} repeated", "either", again, fresh)

    def reuses(layout: str, name: str) -> None:
        turns = conversation(layout, name)
        assert any(run.fed < fresh.fed for fresh, *runs in turns for run in runs), "no request reused a prefix"

    out: List[Tuple[str, Callable[[], None]]] = []
    for check in (answers, reuses):
        label = {answers: "apc_gives_the_uncached_answers", reuses: "apc_reuses_a_prefix"}[check]
        for layout in ("mixed", "own"):
            for name in sorted(CONVERSATIONS):
                out.append((f"{label}[{layout}-{name}]", lambda f=check, a=layout, n=name: f(a, n)))
    return out


def processor_items(model) -> List[Tuple[str, Callable[[], None]]]:
    """(item id, its check) for ``logits_processors`` through the pin's ``generate_step``. The control
    has no tokenizer: its ids 32..126 are read as ASCII characters."""
    from mlx_vlm.generate import generate_step

    from scripts._lib import json_mask as jm
    from scripts._lib.control import EOS_ID, TEXT_ID_LIMIT, VOCAB_SIZE, control_prompt, one_shot_greedy, pin_greedy

    def ids_of(inputs: dict, processors=None, steps: int = 40) -> List[int]:
        return pin_greedy(model, inputs, steps, processors=processors, stop_at=EOS_ID)

    def prompt(inputs: dict) -> List[int]:
        return np.asarray(inputs["input_ids"]).reshape(-1).tolist()

    def identity(case: str) -> None:
        inputs, recorder = control_prompt(case), jm.Identity()
        got = ids_of(inputs, [recorder], steps=MAX_TOKENS)
        assert got == ids_of(inputs, steps=MAX_TOKENS)
        assert got == one_shot_greedy(model, inputs, MAX_TOKENS)[: len(got)]
        jm.check_calls(recorder, prompt(inputs), got, VOCAB_SIZE, [EOS_ID])

    def fixed_document(case: str) -> None:
        inputs, fixed = control_prompt(case), jm.FixedIds([ord(c) for c in jm.FIXED], [EOS_ID])
        ids = ids_of(inputs, [fixed])
        assert ids[-1] == EOS_ID and "".join(map(chr, ids[:-1])) == jm.FIXED
        jm.check_calls(fixed, prompt(inputs), ids, VOCAB_SIZE, [EOS_ID])

    def schema_mask(case: str) -> None:
        inputs = control_prompt(case)
        mask = jm.ChoiceMask(jm.documents(), jm.byte_pieces(VOCAB_SIZE, TEXT_ID_LIMIT), [EOS_ID])
        ids = ids_of(inputs, [mask])
        assert ids[-1] == EOS_ID
        answer = "".join(map(chr, ids[:-1]))
        assert answer in jm.documents() and jm.matches(jm.SCHEMA, json.loads(answer))
        jm.check_calls(mask, prompt(inputs), ids, VOCAB_SIZE, [EOS_ID])

    def ignored_by_the_pin() -> None:
        """0.3.x hands them to the forward pass, which ignores them: an unconstrained answer."""
        inputs, fixed = control_prompt("text_short"), jm.FixedIds([ord(c) for c in jm.FIXED], [EOS_ID])
        got = ids_of(inputs, [fixed], steps=MAX_TOKENS)
        assert not fixed.calls and got == ids_of(inputs, steps=MAX_TOKENS)

    if "logits_processors" not in inspect.signature(generate_step).parameters:
        return [("logits_processors_ignored_by_the_pin", ignored_by_the_pin)]
    out: List[Tuple[str, Callable[[], None]]] = []
    for check in (identity, fixed_document, schema_mask):
        for case in ("image", "text_short"):
            out.append((f"logits_processor_{check.__name__}[{case}]", lambda f=check, n=case: f(n)))
    return out


def pin_json_mask_needs_metal(model, folder: Path) -> None:
    """The pin's llguidance mask (``mlx_vlm.structured``) without Metal: its kernel's error, whatever
    the model. (The control has no tokenizer; the tiny one builds the grammar.)"""
    from mlx_vlm.structured import build_json_schema_logits_processor
    from transformers import AutoTokenizer

    from compass_data.tiny import build_tiny_checkpoint
    from scripts._lib.control import EOS_ID, control_prompt, pin_greedy
    from scripts._lib.json_mask import SCHEMA

    tokenizer = AutoTokenizer.from_pretrained(str(build_tiny_checkpoint(folder.parent / "tiny", layout="original")))
    processor = build_json_schema_logits_processor(tokenizer, SCHEMA)
    try:
        pin_greedy(model, control_prompt("text_short"), 40, processors=[processor], stop_at=EOS_ID)
    except RuntimeError as err:
        assert NO_METAL in str(err), err
        return
    raise AssertionError("the pin's JSON mask ran without Metal")


def speculative_greedy_or_the_pins_failure(folder: Path, kind: str) -> None:
    """The pin's ``generate_step`` with a random dflash drafter of ``kind``: the plain greedy ids,
    or a failure inside mlx-vlm's speculative package."""
    from scripts._lib.control import load_control
    from scripts._lib.speculative import outcome

    outcome(load_control(folder), kind)


def chat_cannot_answer(folder: Path) -> None:
    """``python -m mlx_vlm.chat`` on the control, as a user runs it with the opt-in patch: no
    tokenizer files, so it stops at loading its processor (0.4.x), or loads a Qwen processor with
    an empty vocabulary and every turn is an error (0.6 and later); never an answer to compare."""
    from compass_compat import startup
    from scripts._lib import hook_venv

    python = hook_venv.build(Path(sys.executable), folder.parent / "chat_env")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({startup.ENV: "1", "TERM": "dumb", "COLUMNS": "400", "NO_COLOR": "1"})
    script = [TEXT_PROMPT, "/clear", f"/image {DEMO}", "Describe this picture.", "How many shapes are there?", "/exit"]
    argv = [str(python), "-m", "mlx_vlm.chat", "--model", str(folder), "--temperature", "0"]
    argv += ["--max-tokens", str(MAX_TOKENS)]
    proc = subprocess.run(
        argv, input="\n".join(script) + "\n", capture_output=True, text=True, env=env, cwd=folder.parent, timeout=600
    )
    if "Model loaded successfully" not in proc.stdout:
        assert proc.returncode == 1 and "Fatal error: Can't load image processor" in proc.stdout, (
            proc.stdout[-2000:] + proc.stderr[-2000:]
        )
        return
    said = [piece.split("\nYou: ", 1)[0] for piece in proc.stdout.split("Assistant: ")[1:]]
    assert said and all(turn.lstrip().startswith("Error:") for turn in said), said


def feature_items(folder: Path) -> List[Tuple[str, Callable[[], None]]]:
    """(item id, its check) for the pin's generation features on the control, where the pin has them:
    prompt-cache reuse, the automatic prefix cache, logits processors and their JSON mask,
    speculative decoding and the chat CLI. Each group on a freshly loaded control."""
    import mlx.core as mx

    from scripts._lib import speculative
    from scripts._lib.control import load_control
    from scripts._lib.conversations import CONVERSATIONS, prompt_cache_state_class

    out: List[Tuple[str, Callable[[], None]]] = []
    if prompt_cache_state_class() is not None:
        state_model = load_control(folder)
        for name in sorted(CONVERSATIONS):
            out.append(
                (
                    f"prompt_cache_state_gives_the_uncached_answers[{name}]",
                    lambda n=name: prompt_cache_state_gives_the_uncached_answers(state_model, n),
                )
            )
        if importlib.util.find_spec("mlx_vlm.apc") is not None:
            out += apc_items(folder)
    structured_model = load_control(folder)
    out += processor_items(structured_model)
    if importlib.util.find_spec("mlx_vlm.structured") is not None and not mx.metal.is_available():
        out.append(("pin_json_mask_needs_metal", lambda: pin_json_mask_needs_metal(structured_model, folder)))
    if speculative.speculative_pin():
        for kind in [k for k in ("dflash", "eagle3", "mtp") if k in speculative.draft_kinds()]:
            out.append(
                (
                    f"speculative_greedy_or_the_pins_failure[{kind}]",
                    lambda k=kind: speculative_greedy_or_the_pins_failure(folder, k),
                )
            )
    if importlib.util.find_spec("rich") is not None:  # 0.3.x's chat imports rich, which it does not install
        out.append(("chat_cannot_answer", lambda: chat_cannot_answer(folder)))
    return out


# --------------------------------------------------------------------------- the pin's conversion recipes
# The recipe rule's high layers for the control's 3 (scripts/_lib/recipes.py has the rule), its
# untied head, and the AWQ groups its layers offer (RMSNorms, GQA: q/k/v, gate/up and down_proj).
CONTROL_HIGH_LAYERS = {2}
CONTROL_HEADS = ("language_model.lm_head",)
CONTROL_AWQ = {"layers": 3, "groups": 9}


class _StubTokenizer:
    """The control has no tokenizer files; AWQ's text calibration only encodes its sentences."""

    def encode(self, text: str) -> list:
        return [1 + byte % 239 for byte in text.encode()][:48]


class _StubProcessor:
    tokenizer = _StubTokenizer()

    def save_pretrained(self, path) -> None:
        pass


def recipe_items(folder: Path) -> List[Tuple[str, Callable[[], None]]]:
    """(item id, its check) for every conversion recipe the pin's converter offers, on the control:
    it stores the recipe's rule, and computes what its stored weights say (as the suite checks ours)."""
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_model

    from scripts._lib import control
    from scripts._lib import recipes as r

    work = folder.parent / "recipes"
    prompts = [control.control_prompt("text_long"), control.control_prompt("image")]

    @functools.lru_cache(maxsize=None)
    def converted(recipe: str) -> Tuple[Path, str]:
        return work / recipe, r.convert_with_pin(folder, work / recipe, recipe, _StubProcessor())

    def logits(path: Path) -> list:
        model = load_model(path)
        return [control.one_shot_logits(model, inputs) for inputs in prompts]

    def dense(recipe: str) -> list:
        return logits(r.dequantized_checkpoint(converted(recipe)[0], work / f"{recipe}-dense"))

    def stores_the_rule(recipe: str) -> None:
        want = r.expected_bits(recipe, control.TEXT["num_hidden_layers"], CONTROL_HIGH_LAYERS, CONTROL_HEADS)
        r.assert_stored_as_the_rule(converted(recipe)[0], dict(tree_flatten(load_model(folder).parameters())), want)

    def answers_as_its_weights(recipe: str) -> None:
        for got, want in zip(logits(converted(recipe)[0]), dense(recipe)):
            diff = float(np.abs(got - want).max())
            assert diff <= r.tolerance(recipe, want), (
                f"{recipe}: the converted model computes other logits ({diff:.3g})"
            )

    def awq_keeps_the_function() -> None:
        base = logits(folder)
        applied = r.awq_applied(converted("awq_q8")[1])
        assert applied == CONTROL_AWQ, f"AWQ scaled {applied}, the control's layers offer {CONTROL_AWQ}"
        rtn, awq = r.max_drift(dense("rtn_q8"), base), r.max_drift(dense("awq_q8"), base)
        assert awq <= 3 * rtn, {"rtn_q8": rtn, "awq_q8": awq}

    out: List[Tuple[str, Callable[[], None]]] = []
    for recipe in filter(r.offered, r.RTN):
        out.append((f"recipe_stores_the_rule[{recipe}]", lambda n=recipe: stores_the_rule(n)))
    # Multimodal calibration runs the model's processor, which the control lacks here (torchvision).
    for recipe in [n for n in r.ALL if r.offered(n) and n != "awq_multimodal"]:
        out.append((f"recipe_answers_as_its_weights[{recipe}]", lambda n=recipe: answers_as_its_weights(n)))
    if r.offered("awq_q8"):
        out.append(("awq_keeps_the_function", awq_keeps_the_function))
    return out


def control_items(model, folder: Path) -> List[Tuple[str, Callable[[], None]]]:
    """(item id, its check) for the control itself and the pin's own qwen3_vl defects."""
    from scripts._lib import control

    out: List[Tuple[str, Callable[[], None]]] = [
        (
            "builds_are_byte_identical_and_a_rebuild_writes_nothing",
            lambda: builds_are_byte_identical_and_a_rebuild_writes_nothing(folder),
        ),
        ("loads_exactly_the_built_weights", lambda: loads_exactly_the_built_weights(model)),
    ]
    for case in sorted(control.CASES):
        out.append((f"case_shapes_and_finite_logits[{case}]", lambda n=case: case_shapes_and_finite_logits(model, n)))
    for case in ("image", "two_images"):
        out.append(
            (
                f"pixels_reach_the_logits_only_after_the_first_image[{case}]",
                lambda n=case: pixels_reach_the_logits_only_after_the_first_image(model, n),
            )
        )
    out.append(
        ("a_picture_patchifies_into_the_grid_it_names", lambda: a_picture_patchifies_into_the_grid_it_names(model))
    )
    for case in sorted(control.CASES):
        out.append((f"greedy_paths_agree[{case}]", lambda n=case: greedy_paths_agree(model, n)))
    out.append(("positions_of_one_image_follow_the_rule", lambda: positions_of_one_image_follow_the_rule(model)))
    for check in (no_rope_index_one_image, no_deepstack_dropped, no_chunked_call_restarts_positions):
        out.append((f"pin_defect_absent[{check.__name__[3:]}]", lambda f=check: f(model)))
    return out


# --------------------------------------------------------------------------- the caller contract
def items(model, cases) -> List[Tuple[str, Callable[[], None]]]:
    """(item id, its driver call) for every contract item the control can be driven through."""
    from scripts._lib import contract as c

    out: List[Tuple[str, Callable[[], None]]] = []
    for name in ALL:
        for style in sorted(c.DECODES):
            out.append(
                (f"whole_prefill_then_decode[{name}-{style}]", lambda n=name, s=style: c.item_whole(model, cases[n], s))
            )
    for name in TEXT:
        out.append(
            (f"text_prefill_in_chunks_through_model_call[{name}]", lambda n=name: c.item_model_chunks(model, cases[n]))
        )
    for name in ALL:
        out.append(
            (
                f"prefill_in_chunks_with_the_whole_prompts_kwargs[{name}]",
                lambda n=name: c.item_lm_chunks(model, cases[n]),
            )
        )
    for name in TEXT:
        for mode in c.SUFFIX_MODES:
            out.append(
                (
                    f"text_suffix_after_a_restored_prefix[{name}-{mode}]",
                    lambda n=name, m=mode: c.item_restored(model, cases[n], cases[n].length // 2, m),
                )
            )
    for name in ("image", "two_images"):
        for mode in ("model-call", "primed"):
            out.append(
                (
                    f"text_suffix_after_a_restored_image_prefix[{name}-{mode}]",
                    lambda n=name, m=mode: c.item_restored(model, cases[n], cases[n].vision_end + 2, m),
                )
            )
    if c.has_batch_caches():
        for name in ALL:
            out.append(
                (
                    f"decode_in_a_one_row_batch_cache_with_nothing_passed[{name}]",
                    lambda n=name: c.item_one_row_batch(model, cases[n]),
                )
            )
    for style in ("neither", "rope_deltas"):
        out.append(
            (
                f"two_requests_decoded_in_turn_keep_their_own_delta[{style}]",
                lambda s=style: c.item_interleaved(model, cases["image"], cases["text_long"], s),
            )
        )
    if hasattr(c.make_cache_class(), "merge"):
        merged = [cases["text_long"], cases["image"], cases["two_images"], cases["text_short"]]
        out.append(("requests_merged_into_one_batch_cache_keep_their_own_delta", lambda: c.item_merged(model, merged)))
    return out


def survey() -> Dict[str, str]:
    """Item id -> "pass", or "fail: <why>" (the check's message, first line)."""
    from scripts._lib import contract as c
    from scripts._lib.control import build_control, load_control

    folder = build_control(Path(tempfile.mkdtemp(prefix="control-")) / "control")
    server = None
    if importlib.util.find_spec("uvicorn") is not None:  # mlx-vlm's server; it starts beside the checks below
        from scripts._lib.server import Server

        server = Server(folder, folder.parent / "server.log")
    model = load_control(folder)
    cases = {name: c.control_case(model, name) for name in ALL}
    result = {}
    try:
        checks = control_items(model, folder) + items(model, cases) + server_items(folder, server)
        for item, run in checks + feature_items(folder) + recipe_items(folder):
            try:
                run()
                result[item] = "pass"
            except Exception as err:  # a failed check or the control's own error: both are its failure
                result[item] = f"fail: {type(err).__name__}: " + (str(err).strip().splitlines() or [""])[0][:200]
    finally:
        if server is not None:
            server.stop()
    return result


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the survey (and the comparison) as JSON")
    args = parser.parse_args(argv)
    import compass_compat  # noqa: F401  (the patch, as the suite runs: the control is mlx-vlm's own)

    version = importlib.metadata.version("mlx-vlm")
    result = survey()
    failing = sorted(item for item, verdict in result.items() if verdict != "pass")
    expected = json.loads(EXPECTED.read_text(encoding="utf-8")).get(version)
    for item, verdict in result.items():
        print(f"{verdict[:4]:4}  {item}" + (f"  ({verdict[6:]})" if verdict != "pass" else ""))
    if expected is None:
        print(
            f"control: {len(failing)} of {len(result)} items fail on mlx-vlm {version}; no record for this release: "
            f'add {failing} under "{version}" in {EXPECTED.name}'
        )
        code = 1
    else:
        started, stopped = sorted(set(failing) - set(expected)), sorted(set(expected) - set(failing))
        print(
            f"control: {len(failing)} of {len(result)} items fail on mlx-vlm {version}; "
            + (
                "as recorded"
                if not (started or stopped)
                else f"now failing {started}, now passing {stopped}: "
                "a convention changed, see docs/model-contract.md, then update the record"
            )
        )
        code = 0 if not (started or stopped) else 1
    if args.json:
        args.json.write_text(json.dumps({"mlx_vlm": version, "result": result, "expected": expected}, indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
