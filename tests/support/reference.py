"""The reference model and its input parts, loaded from a checkpoint folder as the recording
scripts need them (torch + transformers >= 5.21; no compass_compat patch).

AutoProcessor needs torchvision, which this torch lacks: the tokenizer and the PIL image
processor are loaded directly.
"""

from __future__ import annotations

import json
import pathlib


def deterministic_torch():
    """torch with one thread and deterministic kernels: re-runs give identical bytes."""
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    return torch


def load_model(folder: pathlib.Path, what: str = "the checkpoint"):
    """transformers' model from ``folder`` (float32, eager attention), in eval mode.

    Exits naming the mismatch when any weight is missing, unexpected or of the wrong shape:
    a recording must never come from a partly initialised model.
    """
    torch = deterministic_torch()
    from transformers import CohereCompassForConditionalGeneration

    model, info = CohereCompassForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    problems = {k: sorted(v) for k, v in info.items() if v}
    if problems:
        raise SystemExit(f"{what} does not match the reference model: {problems}")
    return model.eval()


def tokenizer_and_image_processor(folder: pathlib.Path, *, with_tokenizer_bounds: bool):
    """(tokenizer, CohereCompassImageProcessorPil) of ``folder``.

    ``with_tokenizer_bounds``: give the image processor tokenizer_config.json's
    ``min_pixels``/``max_pixels``, as CohereCompassProcessor merges them in; leave it off when
    the processor built on top merges them itself.
    """
    from transformers import AutoTokenizer
    from transformers.models.cohere_compass import CohereCompassImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(folder)
    kwargs = {}
    if with_tokenizer_bounds:
        bounds = json.loads((pathlib.Path(folder) / "tokenizer_config.json").read_text(encoding="utf-8"))
        kwargs = {k: bounds[k] for k in ("min_pixels", "max_pixels")}
    return tokenizer, CohereCompassImageProcessorPil.from_pretrained(folder, **kwargs)


def greedy_steps(forward, ids, n: int):
    """The reference's greedy ids and step logits [n, V] (numpy), ``n`` steps without a cache and
    without stopping at EOS: each step runs ``forward(seq, use_cache=False)`` on the whole sequence."""
    import numpy as np
    import torch

    seq, greedy, steps = ids, [], []
    for _ in range(n):
        logits = forward(seq, use_cache=False).logits[0, -1]
        greedy.append(int(logits.argmax()))
        steps.append(logits.numpy())
        seq = torch.cat([seq, torch.tensor([[greedy[-1]]])], dim=1)
    return greedy, np.stack(steps)


def cached_greedy(model, forward, ids, n: int):
    """The reference's own cached decode (its sliding-window cache): ``forward(ids, use_cache=True)``,
    then one token a step; the rope deltas of the prefill stay on the model."""
    import torch

    out = forward(ids, use_cache=True)
    cache, logits, got = out.cache, out.logits[0, -1], []
    for _ in range(n):
        got.append(int(logits.argmax()))
        out = model(input_ids=torch.tensor([[got[-1]]]), cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[0, -1]
    return got
