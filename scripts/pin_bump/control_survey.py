"""The control on the installed mlx-vlm, a survey: which items mlx-vlm's own ``qwen3_vl`` (a tiny
random checkpoint, scripts/_lib/control.py) passes. First the control itself (built deterministically,
loaded exactly, its cases' shapes, pixels reaching the logits, its greedy paths agreeing, its image
positions by Qwen3-VL's rule) and the pin's own qwen3_vl defects (an item per defect, failing where
the pin has it); then the caller contract, driven by exactly the calls tests/test_caller_contract.py
makes on ours (scripts/_lib/contract.py) and compared with its own one-shot forward pass.

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
import functools
import importlib.metadata
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Tuple

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
        for item, run in checks + recipe_items(folder):
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
