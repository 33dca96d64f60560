"""Record transformers' training loss and gradients for one (image, question, answer) batch.

tests/test_training.py computes the same loss the way mlx-vlm's trainer does, through our model, on
pins without torch; it compares against what this script writes. Needs torch and transformers >=
5.21 (the reference environment):

    .venvs/mlxvlm-0.7.10/bin/python scripts/reference/training_loss.py

For the tiny checkpoint (compass_data.tiny, random weights) and the toy (compass_data.toy, trained
weights), both float32 in the original layout, loaded with eager attention on CPU: the conversation
[user: image + question, assistant: answer] rendered by the checkpoint's chat template with
``add_generation_prompt=False`` and processed by CohereCompassProcessor gives ``input_ids`` [L];
the same conversation without the answer, with ``add_generation_prompt=True``, gives the prompt
length P. Written to tests/fixtures/training/<checkpoint>.safetensors:

- ``input_ids`` [L], ``prompt_length`` [1];
- ``loss_all``: ``model(..., labels=input_ids).loss`` (every next token);
- ``loss_completion``: the same with ``labels[:P] = -100`` (the answer and the end of turn only);
- ``token_ce`` [L]: position t's cross-entropy against token t + 1, and the last position's
  against the padding id 0 (mlx-vlm 0.4.x-0.6.x count that target when a batch is padded);
- ``grad/<name>``: d loss_completion / d weight for the weights in ``GRAD_WEIGHTS`` (original names);
- ``grad_pad/<name>``: d token_ce[L - 1] / d weight (the padding target 0.4.x-0.6.x may count).

tests/fixtures/training/index.json holds the messages, the image, the versions and the figures.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
from typing import Dict, Optional, Sequence

import numpy as np

from compass_data import tiny, toy
from tests.support.model_outputs import IMAGES_DIR, Reference, require_reference

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "tests" / "fixtures" / "training"
IMAGE = "synth_256x320.png"
QUESTION = "What shape is in the picture?"
ANSWER = "A blue square and a red circle."
PAD_ID = 0  # what both trainers pad a batch with
CHECKPOINTS = {"tiny": tiny.build_tiny_checkpoint, "toy": toy.build_toy_checkpoint}
# Text layers first and last, the vision tower's first block (reached through the merger and
# every deepstack merger), a merger, a deepstack merger, and the tied embedding/head.
GRAD_WEIGHTS = (
    "model.language_model.embed_tokens.weight",
    "model.language_model.layers.0.self_attn.q_proj.weight",
    "model.language_model.layers.7.mlp.down_proj.weight",
    "model.visual.blocks.0.attn.qkv.weight",
    "model.visual.merger.linear_fc2.weight",
    "model.visual.deepstack_merger_list.0.linear_fc2.weight",
)


def messages(with_answer: bool) -> list:
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    answer = {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}
    return [user, answer] if with_answer else [user]


def record_checkpoint(folder: pathlib.Path) -> tuple:
    """(arrays, figures) of one checkpoint folder."""
    import torch
    from PIL import Image

    ref = Reference(folder)
    image = Image.open(IMAGES_DIR / IMAGE).convert("RGB")

    def process(with_answer: bool):
        text = ref.tokenizer.apply_chat_template(
            messages(with_answer), tokenize=False, add_generation_prompt=not with_answer
        )
        # The rendered template already starts with BOS.
        return ref.processor(text=[text], images=[image], add_special_tokens=False, return_tensors="pt")

    full, prompt = process(True), process(False)
    ids, P = full["input_ids"], prompt["input_ids"].shape[1]
    if not torch.equal(full["input_ids"][:, :P], prompt["input_ids"]):
        raise SystemExit("the prompt's tokens are not a prefix of the conversation's")
    inputs = {k: full[k] for k in ("input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids")}

    model = ref.model
    with torch.no_grad():
        model.model.rope_deltas = None
        out = model(**inputs, labels=ids)
        loss_all = out.loss
        targets = torch.cat([ids[0, 1:], torch.tensor([PAD_ID])])
        token_ce = torch.nn.functional.cross_entropy(out.logits[0], targets, reduction="none")
    labels = ids.clone()
    labels[:, :P] = -100
    params = dict(model.named_parameters())
    model.zero_grad()
    model.model.rope_deltas = None
    loss = model(**inputs, labels=labels).loss
    loss.backward()
    grads = {name: params[name].grad.numpy().astype(np.float32) for name in GRAD_WEIGHTS}
    model.zero_grad()
    model.model.rope_deltas = None
    last = model(**inputs).logits[0, -1]
    torch.nn.functional.cross_entropy(last[None], torch.tensor([PAD_ID])).backward()
    arrays = {
        "input_ids": ids[0].numpy().astype(np.int64),
        "prompt_length": np.array([P], dtype=np.int64),
        "loss_all": np.array([loss_all.item()], dtype=np.float32),
        "loss_completion": np.array([loss.item()], dtype=np.float32),
        "token_ce": token_ce.numpy().astype(np.float32),
    }
    for name in GRAD_WEIGHTS:
        arrays[f"grad/{name}"] = grads[name]
        arrays[f"grad_pad/{name}"] = params[name].grad.numpy().astype(np.float32)
    figures = {
        "seq_len": int(ids.shape[1]),
        "prompt_length": P,
        "loss_all": float(loss_all.item()),
        "loss_completion": float(loss.item()),
        "grad_abs_max": {n: float(np.abs(arrays[f"grad/{n}"]).max()) for n in GRAD_WEIGHTS},
    }
    return arrays, figures


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT_DIR, help="fixture directory")
    args = parser.parse_args(argv)
    require_reference()
    import torch
    import transformers
    from safetensors.numpy import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    index: Dict[str, object] = {
        "format": 1,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "image": IMAGE,
        "messages": messages(True),
        "grad_weights": list(GRAD_WEIGHTS),
        "checkpoints": {},
    }
    for name, build in CHECKPOINTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            arrays, figures = record_checkpoint(build(pathlib.Path(tmp) / name))
        path = args.out / f"{name}.safetensors"
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, path)
        path.chmod(0o644)
        index["checkpoints"][name] = {"file": path.name, **figures}
        print(
            f"{name}: L={figures['seq_len']} P={figures['prompt_length']} "
            f"loss_all={figures['loss_all']:.6f} loss_completion={figures['loss_completion']:.6f}"
        )
    (args.out / "index.json").write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
