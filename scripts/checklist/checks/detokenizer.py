"""Item 10: the detokenizer ``mlx_vlm.load`` attaches, fed vocabulary-padding ids."""

from __future__ import annotations

from typing import List

from ..harness import Context
from ..report import FAIL, PASS, CouldNotRun, Item, ItemResult, error_text
from .base import needs_package, result


@needs_package
def check_padding_ids(ctx: Context, item: Item) -> ItemResult:
    """Item 10: the detokenizer ``mlx_vlm.load`` attaches streams padding ids as the reference's
    ``decode`` does: the text is that of the same ids without them."""
    try:
        model, processor = ctx.load(ctx.checkpoint("original"))
        tokenizer = getattr(processor, "tokenizer", processor)
        size, vocab = len(tokenizer), int(model.config.text_config.vocab_size)
        if vocab <= size:
            raise CouldNotRun(f"the tiny checkpoint has no padding rows (vocab_size {vocab}, tokenizer {size})")
        words = tokenizer("the picture shows a red square", add_special_tokens=False)["input_ids"]
        padded = words[:2] + [size, vocab - 1] + words[2:]
        reference = tokenizer.decode(padded)
        if reference != tokenizer.decode(words):  # the reference's own rule, re-checked on this pin
            raise CouldNotRun(f"this transformers decodes padding ids to text: {reference!r}")

        def stream(ids: List[int]) -> str:
            detokenizer = processor.detokenizer
            detokenizer.reset()
            for token in ids:
                detokenizer.add_token(token)
            detokenizer.finalize()
            return detokenizer.text

        want = stream(words)
        try:
            got = stream(padded)
        except Exception as exc:  # the error is the evidence
            return result(
                ctx,
                item,
                FAIL,
                f"streaming ids {padded}: {error_text(exc)}",
                {"ids": padded, "error": error_text(exc)},
            )
    except CouldNotRun:
        raise
    except Exception as exc:  # loading or tokenizing failed: the error is the evidence
        return result(ctx, item, FAIL, error_text(exc), {"error": error_text(exc)})
    details = {
        "ids": padded,
        "tokenizer_size": size,
        "vocab_size": vocab,
        "text": got,
        "expected": want,
        "reference_decode": reference,
        "detokenizer": type(processor.detokenizer).__name__,
    }
    evidence = (
        f"{type(processor.detokenizer).__name__} on ids {padded} (padding ids {size} and {vocab - 1}; "
        f"tokenizer {size}, vocab_size {vocab}): {got!r}"
    )
    if got != want:
        return result(ctx, item, FAIL, evidence + f", without the padding ids {want!r}", details)
    return result(ctx, item, PASS, evidence + ", the same as without them (reference decode: nothing)", details)
