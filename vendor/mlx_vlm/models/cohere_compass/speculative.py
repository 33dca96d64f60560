"""Speculative decoding with cohere_compass: refused by name, before the first token (mlx-vlm's
drafters ask for hidden states this decoder does not return; docs/features.md)."""

from __future__ import annotations

from typing import Any, Mapping

# The language model's keywords that only a speculative round loop passes.
SPECULATIVE_KEYWORDS = (
    "capture_layer_ids",
    "return_hidden",
    "return_shared_kv",
    "speculative_verify",
)


class SpeculativeDecodingUnsupported(ValueError):
    """A drafter (``draft_model`` / ``--draft-model``) was used with cohere_compass."""


def refuse_speculative(kwargs: Mapping[str, Any]) -> None:
    """Raise :class:`SpeculativeDecodingUnsupported` when ``kwargs`` hold a drafter's request."""
    asked = [
        key
        for key in SPECULATIVE_KEYWORDS
        if kwargs.get(key) is not None and kwargs.get(key) is not False
    ]
    if asked:
        raise SpeculativeDecodingUnsupported(
            "cohere_compass does not support speculative decoding (draft_kind dflash, eagle3 or mtp): "
            f"the drafter asked for the decoder's hidden states ({', '.join(asked)}), which it does not "
            "return, and no drafter is trained for this model. Generate without draft_model "
            "(the CLI's and the server's --draft-model); greedy output is the same without it."
        )
