"""mlx-vlm's offline batch API: every row of ``mlx_vlm.batch_generate`` is what the same request
gives alone.

``batch_generate(model, processor, prompts=questions, images=..., max_tokens=...)`` templates each
question itself (one image for each of the first ``len(images)`` prompts), tokenizes the batch
left-padded to one length, groups image rows by picture size and decodes greedily (its batch
generator's default sampler is ``argmax`` on every pin). Rows of very
different lengths, image rows with questions of different lengths (3 rows: 0.6.3 hands each row
``[:1]`` of the ``[3, B, L]`` positions, which keeps the right shape when B = 3) and mixed batches.

Expected text: the recorded transformers reference's greedy ids where the prompt is a reference
case, else ``mlx_vlm.generate`` on the same request alone (greedy), which tests/test_generate.py
ties to the reference.
"""

from __future__ import annotations

import inspect
from typing import List, Optional, Sequence, Tuple

import pytest

from tests.support.vendored import vendored

vendored()
mlx_vlm = pytest.importorskip("mlx_vlm")
if not hasattr(mlx_vlm, "batch_generate"):
    pytest.skip("this mlx-vlm has no batch_generate", allow_module_level=True)

MAX_TOKENS = 12
SQUARE = "synth_448x448.png"
SQUARE_B = "synth_448x448_b.png"  # same size, other picture: one shape group with SQUARE
LONG_QUESTION = "What colour is the square in this picture, and how many circles are there next to it?"

Row = Tuple[str, Optional[str]]  # (question or reference case name, picture file or None)


@pytest.fixture(scope="module")
def loaded(tiny_ckpt_original):
    return mlx_vlm.load(str(tiny_ckpt_original))


def _question(reference, name: str) -> str:
    user = reference(name)["meta"]["messages"][0]["content"]
    return user if isinstance(user, str) else next(p["text"] for p in user if p["type"] == "text")


def _text_of(processor, ids: Sequence[int]) -> str:
    """What batch_generate makes of generated ids: its own detokenizer, stop token dropped."""
    detokenizer = processor.detokenizer
    detokenizer.reset()
    for token in ids:
        detokenizer.add_token(int(token))
    detokenizer.finalize()
    return detokenizer.text


def _reference_text(loaded, reference, name: str) -> str:
    model, processor = loaded
    want = reference(name)["greedy_ids"].tolist()[:MAX_TOKENS]
    eos = model.config.eos_token_id
    eos = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    stop = next((i for i, t in enumerate(want) if t in eos), len(want))
    return _text_of(processor, want[:stop])


def _alone_text(loaded, question: str, picture: Optional[str], fixture_images) -> str:
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = loaded
    prompt = apply_chat_template(processor, model.config, question, num_images=1 if picture else 0)
    extra = {"image": [str(fixture_images[picture])]} if picture else {}
    out = mlx_vlm.generate(model, processor, prompt, max_tokens=MAX_TOKENS, temperature=0.0, verbose=False, **extra)
    return getattr(out, "text", out)


def _batch_texts(
    loaded, rows: List[Tuple[str, Optional[str]]], fixture_images, step: Optional[int] = None
) -> List[Optional[str]]:
    model, processor = loaded
    pictures = [str(fixture_images[p]) for _, p in rows if p]
    # batch_generate gives images to its first len(images) prompts.
    assert all(p for _, p in rows[: len(pictures)]) and not any(p for _, p in rows[len(pictures) :])
    extra = {"prefill_step_size": step} if step else {}
    result = mlx_vlm.batch_generate(
        model, processor, prompts=[q for q, _ in rows], images=pictures or None, max_tokens=MAX_TOKENS, **extra
    )
    return list(result.texts)


def _pin_batches_text_rows_with_images() -> bool:
    """Whether this pin's batch_generate runs the text-only prompts of a batch that has images
    (0.4.4's returns None for them: it loops over the image groups only)."""
    return "text_only_indices" in inspect.getsource(mlx_vlm.batch_generate)


BATCHES = {
    # 10, 42 and 134 prompt tokens: the short rows carry 124 and 92 columns of padding.
    "text_three_lengths": [("text_short", None), ("text_long", None), ("text_medium", None)],
    "images_three_questions": [
        ("img_448", SQUARE),
        (LONG_QUESTION, SQUARE_B),
        ("Count the circles.", SQUARE),
    ],
    "images_two_questions": [("img_448", SQUARE), (LONG_QUESTION, SQUARE_B)],
    # Two picture sizes (two shape groups) and two text rows of very different lengths.
    "mixed": [
        ("img_448", SQUARE),
        ("img_640x480", "synth_640x480.png"),
        (LONG_QUESTION, SQUARE_B),
        ("text_short", None),
        ("text_long", None),
    ],
}


def _batch_generate_cuts_prefill() -> bool:
    """Whether this pin's batch_generate hands ``prefill_step_size`` to its batch generator."""
    from mlx_vlm.generate import BatchGenerator  # type: ignore[attr-defined]

    return "prefill_step_size" in inspect.signature(BatchGenerator).parameters


# Prefill cut every 16 or 100 columns: cuts inside the pictures' vision tokens (196 and 300 of
# them), and last chunks that hold none of a picture row's vision tokens (issue 43).
STEPS = [None, pytest.param(16, id="step16"), pytest.param(100, id="step100")]


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_every_row_equals_the_request_alone(loaded, reference, fixture_images, batch, step):
    if step and not _batch_generate_cuts_prefill():
        pytest.skip(f"mlx-vlm {mlx_vlm.__version__}'s batch_generate takes no prefill_step_size")
    rows, expected = [], []
    for name, picture in BATCHES[batch]:
        if name in reference.cases:
            meta = reference(name)["meta"]
            assert meta["images"] == ([picture] if picture else []), name
            question = _question(reference, name)
            want = _reference_text(loaded, reference, name)
            # The request alone gives the reference too (as tests/test_generate.py checks by ids).
            assert _alone_text(loaded, question, picture, fixture_images) == want, name
        else:
            question = name
            want = _alone_text(loaded, question, picture, fixture_images)
        rows.append((question, picture))
        expected.append(want)

    got = _batch_texts(loaded, rows, fixture_images, step)

    if any(p for _, p in rows) and not _pin_batches_text_rows_with_images():
        # The pin's own limit, not the model's: text rows of an image batch come back None.
        text_rows = [i for i, (_, p) in enumerate(rows) if not p]
        assert [got[i] for i in text_rows] == [None] * len(text_rows)
        rows_checked = [i for i, (_, p) in enumerate(rows) if p]
    else:
        rows_checked = list(range(len(rows)))
    assert [got[i] for i in rows_checked] == [expected[i] for i in rows_checked]


def test_rows_are_told_apart(loaded, reference, fixture_images):
    """The batches above would pass trivially if every row answered alike: the rows' expected
    answers differ."""
    texts = [_reference_text(loaded, reference, n) for n in ("text_short", "text_medium", "text_long", "img_448")]
    assert len(set(texts)) == len(texts)
    alone = [_alone_text(loaded, q, SQUARE, fixture_images) for q in ("Count the circles.", LONG_QUESTION)]
    assert len(set(alone + texts)) == len(alone) + len(texts)
