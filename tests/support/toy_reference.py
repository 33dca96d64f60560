"""The toy's reference answers: transformers' greedy decoding of a prompt (and a picture) on a
checkpoint folder, as scripts/toy/train.py records and evaluates them and tests/test_toy.py re-runs
them live (torch + transformers >= 5.21).
"""

from __future__ import annotations

import json
import pathlib
from typing import List, Optional, Sequence

import numpy as np

from tests.support import reference as _reference

MAX_NEW_TOKENS = 28


class Reference:
    """Tokenizer, chat template and PIL image processor of a checkpoint folder, as transformers
    builds them (the pixel bounds merged in, as CohereCompassProcessor does)."""

    def __init__(self, folder: pathlib.Path):
        self.tokenizer, self.image_processor = _reference.tokenizer_and_image_processor(
            folder, with_tokenizer_bounds=True
        )
        config = json.loads((folder / "config.json").read_text())
        self.image_token_id = config["image_token_id"]
        self.eos_id = config["eos_token_id"]
        self.merge = self.image_processor.merge_size

    def prompt_ids(self, prompt: str, image_tokens: Optional[int], answer: Optional[str] = None):
        """(input ids, number of answer ids at the end): the chat template rendered, the image
        pad expanded to ``image_tokens`` (None: a text-only prompt), the answer and its end of
        turn appended."""
        with_image = image_tokens is not None
        content = [{"type": "image"}, {"type": "text", "text": prompt}] if with_image else prompt
        messages = [{"role": "user", "content": content}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if with_image:
            text = text.replace("<|IMAGE_PAD|>", "<|IMAGE_PAD|>" * image_tokens)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if answer is None:
            return ids, 0
        tail = self.tokenizer(answer, add_special_tokens=False)["input_ids"] + [self.eos_id]
        return ids + tail, len(tail)

    def pixels(self, arrays: Sequence[np.ndarray]):
        """(pixel_values, image_grid_thw) as the processor makes them."""
        from PIL import Image

        out = self.image_processor(images=[Image.fromarray(a) for a in arrays], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def token_grid(self, grid_row) -> tuple:
        """(rows, columns) of merged image tokens for one ``image_grid_thw`` row."""
        _, h, w = (int(v) for v in grid_row)
        return h // self.merge, w // self.merge


def greedy(
    model, ref: Reference, prompt: str, pixels: Optional[np.ndarray], margins: Optional[List[float]] = None
) -> List[int]:
    """The reference's greedy answer ids (cached decode, stops after end of turn); ``margins``
    collects each step's top-1 minus top-2 logit. Not reference.greedy_steps: the toy's answers
    end at end of turn and its prompts are built here, without a processor."""
    import torch

    extra, tokens = {}, None
    if pixels is not None:
        pixel_values, grid = ref.pixels([pixels])
        tokens = int(np.prod(ref.token_grid(grid[0])))
    ids, _ = ref.prompt_ids(prompt, tokens)
    input_ids = torch.tensor([ids])
    if pixels is not None:
        extra = dict(
            pixel_values=pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=(input_ids == ref.image_token_id).long(),
        )
    model.model.rope_deltas = None
    out = model(input_ids=input_ids, use_cache=True, **extra)
    answer: List[int] = []
    for _ in range(MAX_NEW_TOKENS):
        logits = out.logits[0, -1]
        token = int(logits.argmax())
        if margins is not None:
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
        answer.append(token)
        if token == ref.eos_id:
            break
        out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return answer


def decode(ref: Reference, ids: List[int]) -> str:
    return ref.tokenizer.decode(ids, skip_special_tokens=True)
