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
- On 0.7.10 with COMPASS_COMPAT_IMPLEMENTATION=upstream, upstream's own cohere_compass is run the
  same way: either its speculative greedy tokens equal the plain ones, or the failure comes from
  inside mlx-vlm's speculative package (the pin's, reported).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
from importlib.metadata import version

import mlx.core as mx
import pytest

import compass_compat
from tests.support.speculative import (
    STEPS,
    draft_kinds,
    drafter_for,
    outcome,
    speculative_pin,
    step_tokens,
    token_stream,
)

PIN = version("mlx-vlm")
pytestmark = pytest.mark.skipif(
    not speculative_pin(), reason=f"mlx-vlm {PIN}'s generate_step takes no draft_model (no speculative decoding)"
)


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


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "mtp"])
def test_ours_refuses_by_name_before_the_first_token(ours, kind):
    if live_implementation() != "ours":
        pytest.skip("upstream's cohere_compass is live: test_peer_either_works_or_fails_in_the_pin")
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
def test_peer_either_works_or_fails_in_the_pin(ours, kind):
    if kind not in draft_kinds():
        pytest.skip(f"mlx-vlm {PIN} has no draft kind {kind}")
    if live_implementation() != "upstream":
        pytest.skip("our model is live: upstream's cohere_compass is the peer only in the unforced 0.7.10 run")
    print(f"\n[speculative] {PIN} upstream {kind}: {outcome(ours[0], kind)}")


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

    from tests.support.server import Server

    model, _ = ours
    folder = save_drafter(drafter_for(model), tmp_path / "drafter")
    assert load_drafter(str(folder))[1] == "dflash"  # the pin accepts it as a dflash drafter
    with Server(tiny, tmp_path / "server.log", "--draft-model", str(folder), "--draft-kind", "dflash") as server:
        status, body = server.post([{"type": "text", "text": "Hello"}], max_tokens=STEPS)
    print(f"\n[speculative] {PIN} server --draft-model: {status} {str(body)[:160]}")
    assert status == 500 and "cohere_compass does not support speculative decoding" in json.dumps(body)
