"""Speculative decoding (mlx-vlm's ``draft_model`` / ``draft_kind``): refused by name, before any token.

Pins whose ``generate_step`` takes ``draft_model`` (probed from its signature) run a drafter's
round loop: dflash and eagle3 ask the target's prompt pass for per-layer hidden states
(``capture_layer_ids``), mtp for ``return_hidden`` / ``return_shared_kv``. The drafter here is the
pin's own dflash architecture (``speculative.drafters.qwen3_dflash``), random and sized for the
target, so the pin accepts it; a drafter's quality does not matter for the outcome, since greedy
speculative decoding must give the plain greedy tokens or not run.

- Ours has no such hidden states and no trained drafter: every kind is refused by name at the
  prompt's forward pass (vendored ``speculative.refuse_speculative``), before the first token,
  through ``generate_step``, ``stream_generate`` with a picture, and mlx-vlm's server started with
  ``--draft-model`` (the request gets the server's 500 with the refusal as its detail).
- The control (qwen3_vl) and, on 0.7.10 with COMPASS_COMPAT_IMPLEMENTATION=upstream, upstream's own
  cohere_compass are run the same way: either their speculative greedy tokens equal the plain
  ones, or the failure comes from inside mlx-vlm's speculative package (the pin's, reported).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import pathlib
import traceback
from importlib.metadata import version

import mlx.core as mx
import pytest

import compass_compat

PIN = version("mlx-vlm")
STEPS = 6
PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11, 12]


def _speculative_pin() -> bool:
    from mlx_vlm.generate import generate_step

    return "draft_model" in inspect.signature(generate_step).parameters


pytestmark = pytest.mark.skipif(
    not _speculative_pin(), reason=f"mlx-vlm {PIN}'s generate_step takes no draft_model (no speculative decoding)"
)


def draft_kinds() -> list:
    from mlx_vlm.speculative.drafters import KNOWN_DRAFTER_KINDS

    return sorted(KNOWN_DRAFTER_KINDS)


def drafter_for(model):
    """The pin's dflash drafter with random weights, sized for ``model``'s decoder."""
    from mlx_vlm.speculative.drafters.qwen3_dflash.config import DFlashConfig
    from mlx_vlm.speculative.drafters.qwen3_dflash.dflash import DFlashDraftModel

    lm = model.language_model
    layers = len(lm.model.layers)
    vocab, hidden = lm.model.embed_tokens.weight.shape
    config = DFlashConfig.from_dict(
        dict(
            model_type="qwen3_dflash",
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=vocab,
            block_size=4,
            mask_token_id=vocab - 1,
            target_layer_ids=[0, layers - 1],
            num_target_layers=layers,
        )
    )
    drafter = DFlashDraftModel(config)
    mx.eval(drafter.parameters())
    return drafter


def token_stream(model, **kwargs):
    """The pin's ``generate_step`` on a text prompt, greedy, yielding token ids."""
    from mlx_vlm.generate import generate_step

    stream = generate_step(mx.array([PROMPT_IDS]), model, None, None, max_tokens=STEPS, temperature=0.0, **kwargs)
    return (int(mx.array(token).reshape(-1)[0].item()) for token, _ in stream)


def step_tokens(model, **kwargs) -> list:
    return list(token_stream(model, **kwargs))[:STEPS]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> pathlib.Path:
    from compass_data.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), layout="original")


@pytest.fixture(scope="module")
def ours(tiny):
    from mlx_vlm import load

    return load(str(tiny))


def live_implementation() -> str:
    info = compass_compat.implementation_info()
    return "ours" if info.implementation == "vendored" else "upstream"


def outcome(model, kind: str) -> str:
    """'equal' (speculative greedy == plain greedy) or the failure, which must be the pin's."""
    plain = step_tokens(model)
    yielded = []
    try:
        for token in token_stream(model, draft_model=drafter_for(model), draft_kind=kind):
            yielded.append(token)
    except Exception as error:
        where = traceback.extract_tb(error.__traceback__)[-1]
        frames = [f.filename.replace("\\", "/") for f in traceback.extract_tb(error.__traceback__)]
        assert any("/mlx_vlm/speculative/" in f for f in frames), f"{kind} failed outside mlx-vlm's speculative code"
        return (
            f"fails after {len(yielded)} token(s): {type(error).__name__} at "
            f"{where.filename.split('site-packages/')[-1]}:{where.lineno}"
        )
    assert yielded[:STEPS] == plain, f"{kind}: speculative greedy {yielded} != plain greedy {plain}"
    return "equal to plain greedy"


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "mtp"])
def test_ours_refuses_by_name_before_the_first_token(ours, kind):
    if live_implementation() != "ours":
        pytest.skip("upstream's cohere_compass is live: test_peer_and_control_either_work_or_fail_in_the_pin")
    if kind not in draft_kinds():
        pytest.skip(f"mlx-vlm {PIN} has no draft kind {kind}")
    from mlx_vlm.models.cohere_compass.speculative import SpeculativeDecodingUnsupported

    model, _ = ours
    stream = token_stream(model, draft_model=drafter_for(model), draft_kind=kind)
    with pytest.raises(SpeculativeDecodingUnsupported) as info:
        next(stream)  # the first token: the prompt's forward pass refuses before it exists
    message = str(info.value)
    assert "cohere_compass does not support speculative decoding" in message and "draft_model" in message
    assert ("capture_layer_ids" if kind != "mtp" else "return_hidden") in message
    print(f"\n[speculative] {PIN} ours {kind}: {message[:120]}")
    # Without a drafter the same model answers as before: the check looks at the drafter's keywords only.
    assert len(step_tokens(model)) == STEPS


def test_ours_refuses_through_stream_generate_with_a_picture(ours, fixture_images):
    if live_implementation() != "ours":
        pytest.skip("upstream's cohere_compass is live")
    from mlx_vlm import stream_generate
    from mlx_vlm.models.cohere_compass.speculative import SpeculativeDecodingUnsupported
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = ours
    prompt = apply_chat_template(processor, model.config, "Describe the image.", num_images=1)
    image = str(fixture_images["synth_320x256.png"])
    texts = []
    with pytest.raises(SpeculativeDecodingUnsupported):
        for result in stream_generate(
            model,
            processor,
            prompt,
            image=[image],
            max_tokens=STEPS,
            draft_model=drafter_for(model),
            draft_kind="dflash",
        ):
            texts.append(result.text)
    assert texts == []
    assert "".join(r.text for r in stream_generate(model, processor, prompt, image=[image], max_tokens=STEPS))


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "mtp"])
@pytest.mark.parametrize("who", ["control", "upstream"])
def test_peer_and_control_either_work_or_fail_in_the_pin(ours, control_ckpt, who, kind):
    if kind not in draft_kinds():
        pytest.skip(f"mlx-vlm {PIN} has no draft kind {kind}")
    if who == "upstream" and live_implementation() != "upstream":
        pytest.skip("our model is live: upstream's cohere_compass is the peer only in the unforced 0.7.10 run")
    if who == "control":
        from scripts._lib.control import load_control

        model = load_control(pathlib.Path(control_ckpt))
    else:
        model = ours[0]
    print(f"\n[speculative] {PIN} {who} {kind}: {outcome(model, kind)}")


def _server_takes_a_drafter() -> bool:
    spec = importlib.util.find_spec("mlx_vlm.server.cli") if importlib.util.find_spec("mlx_vlm.server") else None
    return spec is not None and "--draft-model" in pathlib.Path(spec.origin).read_text(encoding="utf-8")


def save_drafter(drafter, folder: pathlib.Path) -> pathlib.Path:
    """A drafter folder the pin's ``load_drafter`` (the server's ``--draft-model``) loads."""
    from mlx.utils import tree_flatten

    folder.mkdir(parents=True)
    config = {k: v for k, v in vars(drafter.config).items() if not k.startswith("_")}
    config["model_type"] = "qwen3_dflash"
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(drafter.parameters())))
    return folder


def test_the_server_with_a_drafter_answers_with_the_refusal(ours, tiny, tmp_path):
    if live_implementation() != "ours":
        pytest.skip("upstream's cohere_compass is live")
    if not _server_takes_a_drafter():
        pytest.skip(f"mlx-vlm {PIN}'s server has no --draft-model")
    pytest.importorskip("uvicorn")
    from mlx_vlm.speculative.drafters import load_drafter

    from scripts._lib.server import Server

    model, _ = ours
    folder = save_drafter(drafter_for(model), tmp_path / "drafter")
    assert load_drafter(str(folder))[1] == "dflash"  # the pin accepts it as a dflash drafter
    with Server(tiny, tmp_path / "server.log", "--draft-model", str(folder), "--draft-kind", "dflash") as server:
        status, body = server.post([{"type": "text", "text": "Hello"}], max_tokens=STEPS)
    print(f"\n[speculative] {PIN} server --draft-model: {status} {str(body)[:160]}")
    assert status == 500 and "cohere_compass does not support speculative decoding" in json.dumps(body)
