"""Fine-tuning through mlx-vlm's own trainer: its loss and gradients on our model equal the reference's.

The batch is built and the loss computed by the installed pin's trainer code (its dataset class,
its batching, its loss function), on our model; the expected losses and gradients are
transformers' (tests/fixtures/training, scripts/reference/training_loss.py) for the same
conversation, image and checkpoint. The trainer is probed by module, not by version: 0.4.x-0.6.x
``mlx_vlm.trainer.sft_trainer``, 0.7.x ``mlx_vlm.trainer.vlm.sft``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import pathlib
from types import SimpleNamespace
from typing import Any, Callable, Dict, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from PIL import Image

from compass_data.toy import build_toy_checkpoint
from tests.support.vendored import vendored

FIXTURE_DIR = pathlib.Path(__file__).resolve().parent / "fixtures" / "training"
INDEX = json.loads((FIXTURE_DIR / "index.json").read_text(encoding="utf-8"))
IMAGES_DIR = pathlib.Path(__file__).resolve().parent / "fixtures" / "images"
CHECKPOINTS = tuple(INDEX["checkpoints"])
# The assistant-turn marker of this chat template ('<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>'):
# the trainer's --assistant-id for it. The tiny tokenizer's id; a real checkpoint's comes from
# processor.tokenizer.convert_tokens_to_ids("<|CHATBOT_TOKEN|>").
CHATBOT_TOKEN = "<|CHATBOT_TOKEN|>"
# float32 on both sides; the sums differ in order only.
LOSS_TOL = 1e-5
GRAD_TOL = 1e-4  # relative to the largest entry of each reference gradient

vendored()  # skips the module when upstream's cohere_compass is live


def _has(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


class PinTrainer(NamedTuple):
    """The installed pin's trainer pieces: rows -> one batch, (model, batch) -> loss, LoRA setup."""

    batch: Callable[..., Dict[str, Any]]
    loss: Callable[..., mx.array]
    add_lora: Callable[[nn.Module], nn.Module]
    raw_template: bool = False


def _trainer_07() -> PinTrainer:
    from mlx_vlm.trainer.common.model import prepare_model_for_training
    from mlx_vlm.trainer.vlm.sft.dataset import VisionDataset
    from mlx_vlm.trainer.vlm.sft.runtime import iterate_vlm_batches, vlm_sft_loss

    def batch(model, processor, rows, completions: bool):
        dataset = VisionDataset(rows, model.config, processor, config={"train_on_completions": completions})
        return next(iter(iterate_vlm_batches(dataset, 1, 2048)))

    def loss(model, batch, completions: bool, assistant_id=77091):
        return vlm_sft_loss(model, batch, train_on_completions=completions, assistant_id=assistant_id)[0]

    def add_lora(model):
        return prepare_model_for_training(model, train_type="lora", verbose=False)

    return PinTrainer(batch, loss, add_lora)


def _trainer_06() -> PinTrainer:
    from mlx_vlm.trainer import datasets
    from mlx_vlm.trainer.datasets import VisionDataset
    from mlx_vlm.trainer.sft_trainer import iterate_batches, vision_language_loss_fn
    from mlx_vlm.trainer.utils import find_all_linear_names, get_peft_model

    # 0.4.x-0.6.3's dataset makes no completion_mask: the loss finds the answer by --assistant-id.
    makes_mask = "train_on_completions" in inspect.signature(VisionDataset).parameters

    def batch(model, processor, rows, completions: bool):
        options = {"train_on_completions": completions} if makes_mask else {}
        dataset = VisionDataset(rows, model.config.__dict__, processor, **options)
        batch = next(iterate_batches(dataset, 1, 2048))
        length = np.asarray(dataset[0]["input_ids"]).size
        if batch["input_ids"].shape[1] < length:
            pytest.skip(
                f"this mlx-vlm's iterate_batches cuts the {length}-token row to {batch['input_ids'].shape[1]} "
                "tokens (0.4.x takes a [1, L] row's length as 1): no image row trains on it"
            )
        return batch

    def loss(model, batch, completions: bool, assistant_id=77091):
        return vision_language_loss_fn(model, batch, train_on_completions=completions, assistant_id=assistant_id)

    def add_lora(model):
        names = find_all_linear_names(model.language_model)
        return get_peft_model(model, names, rank=8, alpha=16, dropout=0.0, verbose=False)

    return PinTrainer(batch, loss, add_lora, raw_template=hasattr(datasets, "get_prompt"))


@functools.lru_cache(maxsize=None)
def pin_trainer() -> PinTrainer:
    if _has("mlx_vlm.trainer.vlm.sft.runtime"):
        return _trainer_07()
    if _has("mlx_vlm.trainer.sft_trainer") and _has("mlx_vlm.trainer.datasets"):
        return _trainer_06()
    pytest.fail("this mlx-vlm has neither mlx_vlm.trainer.vlm.sft nor mlx_vlm.trainer.sft_trainer")


def rows(trainer: PinTrainer) -> list:
    """The fixture's conversation as a dataset row in the format the pin's trainer reads."""
    user, answer = INDEX["messages"]
    image = Image.open(IMAGES_DIR / INDEX["image"]).convert("RGB")
    if trainer.raw_template:  # 0.4.x renders the rows with the tokenizer's template as they are
        return [{"images": [image], "messages": INDEX["messages"]}]
    question = next(p["text"] for p in user["content"] if p["type"] == "text")
    text = next(p["text"] for p in answer["content"] if p["type"] == "text")
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": text}]
    return [{"images": [image], "messages": messages}]


@pytest.fixture(scope="module")
def folders(tiny_ckpt_original, tmp_path_factory) -> Dict[str, pathlib.Path]:
    toy = build_toy_checkpoint(tmp_path_factory.mktemp("toy"), layout="original")
    return {"tiny": tiny_ckpt_original, "toy": toy}


def load(folder: pathlib.Path):
    from mlx_vlm.utils import load as mlx_vlm_load

    return mlx_vlm_load(str(folder))


@functools.lru_cache(maxsize=None)
def expected(name: str) -> Dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in mx.load(str(FIXTURE_DIR / INDEX["checkpoints"][name]["file"])).items()}


def our_key(name: str) -> str:
    from mlx_vlm.models.cohere_compass.config import weight_key

    return weight_key(name, tied=False)


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("completions", [False, True], ids=["all_tokens", "completion_only"])
def test_trainer_loss_equals_reference(folders, name, completions):
    trainer = pin_trainer()
    model, processor = load(folders[name])
    batch = trainer.batch(model, processor, rows(trainer), completions)
    ref = expected(name)
    L, P = ref["input_ids"].shape[0], int(ref["prompt_length"][0])
    np.testing.assert_array_equal(np.array(batch["input_ids"])[0, :L], ref["input_ids"])
    assistant_id = processor.tokenizer.convert_tokens_to_ids(CHATBOT_TOKEN)
    loss = trainer.loss(model, batch, completions, assistant_id).item()
    weights = target_weights(trainer, model, batch, completions, assistant_id)
    # The targets transformers counts (labels with the prompt at -100), and none past the
    # conversation but the first padding id (0.4.x-0.6.x mask by input length, not target).
    labelled = np.arange(L - 1) >= (P - 1 if completions else 0)
    np.testing.assert_array_equal(weights[: L - 1] > 0, labelled)
    assert not weights[L:].any()
    # transformers' per-token losses, weighted as the pin weighs them.
    want = float((weights[:L] * ref["token_ce"][:L]).sum())
    assert abs(loss - want) <= LOSS_TOL * max(1.0, abs(want)), (loss, want)
    if np.allclose(weights[: L - 1], labelled / labelled.sum(), rtol=1e-6, atol=0) and not weights[L - 1]:
        # The pin's loss is transformers' (0.7.x): compare with transformers' own figure too.
        transformers_loss = float(ref["loss_completion" if completions else "loss_all"][0])
        assert abs(loss - transformers_loss) <= LOSS_TOL * max(1.0, transformers_loss)


def test_reference_token_losses_give_transformers_loss():
    """The recorded per-token losses are transformers' loss, position by position."""
    for name in CHECKPOINTS:
        ref = expected(name)
        L, P = ref["input_ids"].shape[0], int(ref["prompt_length"][0])
        np.testing.assert_allclose(ref["token_ce"][: L - 1].mean(), ref["loss_all"][0], rtol=1e-6)
        np.testing.assert_allclose(ref["token_ce"][P - 1 : L - 1].mean(), ref["loss_completion"][0], rtol=1e-6)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_trainer_gradients_equal_reference(folders, name):
    trainer = pin_trainer()
    model, processor = load(folders[name])
    batch = trainer.batch(model, processor, rows(trainer), True)
    assistant_id = processor.tokenizer.convert_tokens_to_ids(CHATBOT_TOKEN)
    ref = expected(name)
    L, P = ref["input_ids"].shape[0], int(ref["prompt_length"][0])
    # The pin weighs each answer target alike (0.6.3 divides by every target, not the answer's)
    # and may count the padding target after the end: transformers' gradients weighted alike.
    weights = target_weights(trainer, model, batch, True, assistant_id)
    np.testing.assert_allclose(weights[P - 1 : L - 1], weights[P - 1], rtol=1e-6)
    assert not weights[: P - 1].any() and not weights[L:].any()
    answer, pad = float(weights[P - 1 : L - 1].sum()), float(weights[L - 1])
    model.unfreeze()
    loss_fn = nn.value_and_grad(model, lambda m, b: trainer.loss(m, b, True, assistant_id))
    grads = dict(tree_flatten(loss_fn(model, batch)[1]))
    for weight in INDEX["grad_weights"]:
        want = answer * ref[f"grad/{weight}"] + pad * ref[f"grad_pad/{weight}"]
        got = np.array(grads[our_key(weight)])
        size = np.abs(want).max()
        assert size > 0 and np.abs(got).max() > 0, weight  # vision weights too: the graph is connected
        err = np.abs(got - want).max() / size
        assert err <= GRAD_TOL, (weight, err)


def test_zero_lora_update_gives_base_logits(folders):
    trainer = pin_trainer()
    model, processor = load(folders["toy"])
    batch = trainer.batch(model, processor, rows(trainer), False)
    args = (batch["input_ids"][:, :-1], batch["pixel_values"], batch["attention_mask"][:, :-1])
    extra = {k: batch[k] for k in ("image_grid_thw", "mm_token_type_ids")}
    base = np.array(model(*args, **extra).logits)
    trainer.add_lora(model)
    adapted = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert adapted and all(".lora_" in k for k in adapted), adapted[:4]
    np.testing.assert_array_equal(np.array(model(*args, **extra).logits), base)


def target_weights(trainer: PinTrainer, model, batch, completions: bool, assistant_id: int) -> np.ndarray:
    """The weight the pin's loss gives each logit position's cross-entropy (``[T]``).

    Measured on a stand-in that returns zero logits plus a trainable offset: each position's
    cross-entropy then has gradient ``weight * (1/V - onehot(target))`` in its offset.
    """
    ids = np.array(batch["input_ids"])
    V = model.config.text_config.vocab_size
    probe = ZeroLogits(model, (1, ids.shape[1] - 1, V))
    loss_fn = nn.value_and_grad(probe, lambda m, b: trainer.loss(m, b, completions, assistant_id))
    grad = np.array(loss_fn(probe, batch)[1]["offset"][0])
    return grad[np.arange(grad.shape[0]), ids[0, 1:]] / (1.0 / V - 1.0)


class ZeroLogits(nn.Module):
    """Takes what the trainer passes our model and returns zero logits plus ``offset``."""

    def __init__(self, model: nn.Module, shape):
        super().__init__()
        self.config, self.model_type = model.config, model.model_type
        self.offset = mx.zeros(shape)

    def __call__(self, input_ids, *args, **kwargs):
        return SimpleNamespace(logits=self.offset)


@pytest.mark.parametrize("source", ["completion_mask", "assistant_id"])
def test_completion_only_loss_gives_prompt_tokens_no_loss(folders, source):
    """Both ways the trainer finds the answer: the dataset's completion_mask (the prompt rendered
    with the generation prompt) and, without it, the first ``--assistant-id`` token."""
    trainer = pin_trainer()
    model, processor = load(folders["tiny"])
    batch = trainer.batch(model, processor, rows(trainer), True)
    if source == "assistant_id":
        batch = {k: v for k, v in batch.items() if k != "completion_mask"}
    elif "completion_mask" not in batch:
        pytest.skip("this mlx-vlm's dataset makes no completion_mask (0.4.x-0.6.3): --assistant-id finds the answer")
    assistant_id = processor.tokenizer.convert_tokens_to_ids(CHATBOT_TOKEN)
    ids = np.array(batch["input_ids"])
    counted = target_weights(trainer, model, batch, True, assistant_id) > 0
    P, L = int(expected("tiny")["prompt_length"][0]), expected("tiny")["input_ids"].shape[0]
    # Logit t predicts token t + 1: no prompt target, every answer target and the end of turn.
    assert not counted[: P - 1].any()
    assert counted[P - 1 : L - 1].all()
    assert ids[0, P - 1] == assistant_id and np.count_nonzero(ids[0, :L] == assistant_id) == 1


IMAGE_PAD = 510  # the tiny tokenizer's <|IMAGE_PAD|>


def _fit(types, ids):
    fit = vendored("cohere_compass").fit_training_batch
    return fit(mx.array(ids), None, None, np.array(types), None, [IMAGE_PAD, 511])[2]


def test_fit_training_batch_fits_only_the_trainers_shapes():
    p = IMAGE_PAD
    # The trainer's shift drops the last column (text); padding or a completion adds text.
    np.testing.assert_array_equal(_fit([[0, 1, 1, 0, 0]], [[5, p, p, 7]]), [[0, 1, 1, 0]])
    np.testing.assert_array_equal(_fit([[0, 1, 1]], [[5, p, p, 0, 0]]), [[0, 1, 1, 0, 0]])
    np.testing.assert_array_equal(_fit([[0, 1, 1]], [[5, p, p]]), [[0, 1, 1]])
    with pytest.raises(ValueError, match="never an image or video token"):
        _fit([[0, 1, 1, 0, 1]], [[5, p, p, 7]])  # the dropped column is an image token
    with pytest.raises(ValueError, match="has 6 columns but input_ids has 4"):
        _fit([[0, 1, 1, 0, 0, 0]], [[5, p, p, 7]])
    with pytest.raises(ValueError, match="has 3 columns but input_ids has 5"):
        _fit([[0, 1, 1]], [[5, p, p, p, 0]])  # an added column is an image token
    with pytest.raises(ValueError, match="one row per prompt"):
        _fit([[0, 1, 1, 0], [0, 1, 1, 0]], [[5, p, p, 0]])


def test_a_compiled_step_is_refused_by_name(tiny_ckpt_original):
    """mlx-vlm's ``--compile`` (0.7.x) and its ORPO step (0.6.x) run the model under ``mx.compile``;
    the model reads token ids on the host, so it says so instead of MLX's bare eval error."""
    from mlx_vlm.utils import load_model
    from packaging.version import Version

    if Version(mx.__version__) < Version("0.32.4"):
        # Measured: mlx 0.31.2 and 0.32.3 report the host read only after tracing (a bare
        # ValueError outside any model frame) or fail the interpreter (SystemError: unknown opcode).
        pytest.skip(f"mlx {mx.__version__} does not raise a host read under mx.compile where it happens")

    model = load_model(tiny_ckpt_original)
    ids = mx.array([[5, 6, 7, 8]])
    step = mx.compile(lambda tokens: model(tokens, pixel_values=mx.zeros((4, 1536)), image_grid_thw=[[1, 2, 2]]).logits)
    with pytest.raises(ValueError, match="cannot run under mx.compile"):
        step(ids)
