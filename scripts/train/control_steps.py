"""A few LoRA steps on the tiny ``qwen3_vl`` control, by hand through the pin's trainer functions.

    PYTHONPATH=. .venvs/mlxvlm-<pin>/bin/python scripts/train/control_steps.py [--steps 5]

The control (``scripts/_lib/control.py``) has no processor or tokenizer, so the trainer CLIs cannot
load it; its inputs are made by hand (``control_prompt("image")``: text, one 4x6-patch picture,
text) and passed as the batch the trainer's loss reads (``input_ids``, ``attention_mask``,
``pixel_values``, ``image_grid_thw``). The pin's own pieces do the rest: LoRA from
``prepare_model_for_training`` (0.7.x) or ``get_peft_model`` (0.4.x-0.6.x), the loss
``vlm_sft_loss`` or ``vision_language_loss_fn``, Adam. Prints the loss per step, then whether the
same step runs under ``mx.compile`` (what ``--compile`` and 0.x ORPO do).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

from scripts._lib import control


def pin_pieces() -> Tuple[Callable, Callable]:
    """(add LoRA to a model, loss of (model, batch)) from the installed pin's trainer."""
    if importlib.util.find_spec("mlx_vlm.train"):  # 0.7.x's trainer package
        from mlx_vlm.trainer.common.model import prepare_model_for_training
        from mlx_vlm.trainer.vlm.sft.runtime import vlm_sft_loss

        def add_lora(model):
            return prepare_model_for_training(model, train_type="lora", verbose=False)

        return add_lora, lambda model, batch: vlm_sft_loss(model, batch)[0]
    from mlx_vlm.trainer.sft_trainer import vision_language_loss_fn
    from mlx_vlm.trainer.utils import find_all_linear_names, get_peft_model

    def add_lora(model):
        names = find_all_linear_names(model.language_model)
        return get_peft_model(model, names, rank=8, alpha=16, dropout=0.0, verbose=False)

    return add_lora, vision_language_loss_fn


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--learning-rate", type=float, default=5e-3)
    args = parser.parse_args(argv)
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import mlx_vlm

    add_lora, loss = pin_pieces()
    with tempfile.TemporaryDirectory(prefix="compass-control-train-") as tmp:
        model = control.load_control(control.build_control(Path(tmp) / "control"))
    inputs = control.control_prompt("image")
    batch = {
        "input_ids": inputs["input_ids"],
        "attention_mask": inputs["mask"],
        "pixel_values": inputs["pixel_values"],
        "image_grid_thw": inputs["image_grid_thw"],
    }
    model = add_lora(model)
    optimizer = optim.Adam(learning_rate=args.learning_rate)
    step = nn.value_and_grad(model, loss)
    print(
        f"mlx-vlm {mlx_vlm.__version__}, mlx {mx.__version__}: control qwen3_vl, LoRA, {batch['input_ids'].shape[1]} tokens"
    )
    losses = []
    for i in range(args.steps):
        value, grads = step(model, batch)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)
        losses.append(value.item())
        print(f"step {i + 1}: loss {losses[-1]:.4f}")
    try:
        compiled = mx.compile(lambda b: loss(model, b))
        print(f"under mx.compile: ok, loss {compiled(batch).item():.4f}")
    except Exception as error:  # reported, not raised: which error the control gives is the finding
        print(f"under mx.compile: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
