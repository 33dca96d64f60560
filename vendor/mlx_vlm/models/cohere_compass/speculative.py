"""Speculative decoding with cohere_compass: refused by name, before the first token.

mlx-vlm's drafters read the target's per-layer hidden states from the prompt's forward pass:
dflash and eagle3 ask for them with ``capture_layer_ids``, mtp with ``return_hidden`` /
``return_shared_kv``. This decoder returns logits only and no drafter is trained for it, so
without this check the pin fails later, inside its round loop, with a ``TypeError`` from
``mx.concatenate`` or a ``None`` subscript (measured on mlx-vlm 0.6.12 and 0.7.10; the pins' own
qwen3_vl fails the same way).
"""

from __future__ import annotations

from typing import Any, Mapping

# The language model's keywords that only a speculative round loop passes.
SPECULATIVE_KEYWORDS = ("capture_layer_ids", "return_hidden", "return_shared_kv", "speculative_verify")


class SpeculativeDecodingUnsupported(ValueError):
    """A drafter (``draft_model`` / ``--draft-model``) was used with cohere_compass."""


def refuse_speculative(kwargs: Mapping[str, Any]) -> None:
    """Raise :class:`SpeculativeDecodingUnsupported` when ``kwargs`` hold a drafter's request."""
    asked = [key for key in SPECULATIVE_KEYWORDS if kwargs.get(key) is not None and kwargs.get(key) is not False]
    if asked:
        raise SpeculativeDecodingUnsupported(
            "cohere_compass does not support speculative decoding (draft_kind dflash, eagle3 or mtp): "
            f"the drafter asked for the decoder's hidden states ({', '.join(asked)}), which it does not "
            "return, and no drafter is trained for this model. Generate without draft_model "
            "(the CLI's and the server's --draft-model); greedy output is the same without it."
        )
