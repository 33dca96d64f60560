"""Train through the pin's own trainer CLI in this interpreter and record the trained model's greedy text.

    PYTHONPATH=. [COMPASS_COMPAT_FORCE_VENDORED=1] .venvs/mlxvlm-<pin>/bin/python \\
        scripts/train/trained_text.py --model TINY --out OUT [--iters 10] [--full] [--fuse]

Writes a dataset of shape pictures (``probe_modes.write_datasets``), then runs
``python -m mlx_vlm.train`` (0.7.x) or ``python -m mlx_vlm.lora`` (0.4.x-0.6.x) as ``__main__`` in
this interpreter with mlx-vlm's ``load`` wrapped to keep the model it returns: the trainer changes
that model in place (LoRA layers, updated weights), so once the run ends it is the trained model.
The greedy text of that model, and of a fresh base load, for the first training picture and its
question go to ``OUT/trained_text.json`` with the adapter folder (``OUT/adapters``).

``--full`` trains every language-model weight (``--train-type full`` / ``--full-finetune``) instead
of LoRA. ``--fuse`` also writes ``OUT/checkpoint``: a checkpoint folder that loads with no adapter,
the trained model's weights (LoRA layers fused with their own ``fuse()``) beside the base folder's
config and tokenizer files. No pin has a fuse command for mlx-vlm models; this is one by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import runpy
import shutil
import sys
from typing import Any, List, Optional, Sequence, Tuple

import compass_compat  # noqa: F401  (applies the patch: the trainer CLIs import mlx-vlm only)
from scripts.train import probe_modes

MAX_TOKENS = 8
# Large enough that a few steps move the tiny random model's greedy text.
LEARNING_RATE = "2e-3"


def train_in_process(cli_args: Sequence[str]) -> Tuple[Any, Any]:
    """Run the pin's trainer CLI as ``__main__`` here; the (model, processor) it trained."""
    import mlx_vlm
    import mlx_vlm.utils

    loaded: List[Tuple[Any, Any]] = []
    original = mlx_vlm.utils.load

    def keep(*args, **kwargs):
        result = original(*args, **kwargs)
        loaded.append(result)
        return result

    # 0.7.x's CLI imports load from mlx_vlm when it runs, 0.4.x-0.6.x's from mlx_vlm.utils.
    saved_argv = sys.argv
    mlx_vlm.load = mlx_vlm.utils.load = keep
    sys.argv = [probe_modes.cli(), *cli_args]
    try:
        with contextlib.suppress(SystemExit):
            runpy.run_module(probe_modes.cli(), run_name="__main__", alter_sys=True)
    finally:
        mlx_vlm.load = mlx_vlm.utils.load = original
        sys.argv = saved_argv
    if not loaded:
        raise RuntimeError(f"python -m {probe_modes.cli()} loaded no model through mlx-vlm's load")
    model, processor = loaded[0]  # DPO's reference model is the second load
    model.eval()
    return model, processor


def greedy_text(model, processor, image: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    """mlx-vlm's greedy text for one picture and question, formatted as its generate CLI does."""
    from mlx_vlm import stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    formatted = apply_chat_template(processor, model.config, prompt, num_images=1)
    pieces = stream_generate(model, processor, formatted, image=[image], max_tokens=max_tokens, temperature=0.0)
    return "".join(piece.text for piece in pieces)


def fuse_lora(model) -> int:
    """Replace every LoRA/DoRA layer with its fused plain layer; how many were fused."""
    from mlx.utils import tree_unflatten

    fused = [(name, module.fuse()) for name, module in model.named_modules() if hasattr(module, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    return len(fused)


def write_checkpoint(model, base: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """``model``'s weights in mlx-vlm's layout beside ``base``'s non-weight files."""
    from mlx_vlm.utils import save_weights

    out.mkdir(parents=True)
    for item in base.iterdir():
        if item.is_file() and not item.name.startswith("model") and item.suffix != ".safetensors":
            shutil.copy2(item, out / item.name)
    save_weights(out, model)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=pathlib.Path, required=True, help="base checkpoint folder")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    parser.add_argument("--fuse", action="store_true", help="also write OUT/checkpoint (see above)")
    args = parser.parse_args(argv)
    import mlx_vlm

    args.out.mkdir(parents=True, exist_ok=True)
    data = probe_modes.write_datasets(args.out / "data")["sft"]
    first = json.loads((data / "train.jsonl").read_text(encoding="utf-8").splitlines()[0])
    image, prompt = first["images"][0], first["messages"][0]["content"]
    adapters = args.out / "adapters"
    full = probe_modes.MODES["full"][probe_modes.cli()] if args.full else []
    common = ["--iters", str(args.iters), "--batch-size", "1", "--learning-rate", LEARNING_RATE]
    common += ["--steps-per-report", "1", "--output-path", str(adapters), *full]
    if probe_modes.cli() == probe_modes.NEW_CLI:
        cli_args = ["--model", str(args.model), "--data", str(data), "--steps-per-eval", "1000", *common]
    else:
        cli_args = ["--model-path", str(args.model), "--dataset", str(data), *common]

    model, processor = train_in_process(cli_args)
    record = {
        "mlx_vlm": mlx_vlm.__version__,
        "command": f"python -m {probe_modes.cli()} " + " ".join(cli_args),
        "image": image,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "adapters": str(adapters),
        "trained_text": greedy_text(model, processor, image, prompt),
    }
    if args.fuse:
        record["fused_layers"] = fuse_lora(model)
        record["checkpoint"] = str(write_checkpoint(model, args.model, args.out / "checkpoint"))
    del model
    base, base_processor = mlx_vlm.utils.load(str(args.model))
    record["base_text"] = greedy_text(base, base_processor, image, prompt)
    (args.out / "trained_text.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
