"""Teach the toy a question it cannot answer, with mlx-vlm's own trainer, and measure it on held-out pictures.

    COMPASS_COMPAT_FORCE_VENDORED=1 PYTHONPATH=. .venvs/mlxvlm-0.7.10/bin/python scripts/train/learn_shapes.py \\
        [--iters 600] [--train 400] [--held-out 60] [--learning-rate 1e-4] [--train-vision] [--out record.json]

The question is "Which shape is the largest?" and the answer is "The <colour> <kind>." The toy
was never trained on it (compass_data.shapes asks describe / count / colour / where), so before
training it gets none right. The answer has 16 colour x kind combinations; chance is 1/16
without the picture, 1/2-1/3 if it could only name a shape in the picture.

Pictures are plain 192 x 192 scenes of 2-3 shapes whose largest is at least 20% wider than the
next (so the answer is unambiguous). Training pictures come from seed 1001 and the held-out ones
from seed 1002; the held-out pictures are never trained on. The rows are written in the format
the trainer reads from disk (docs/fine-tuning.md): ``train.jsonl`` and ``valid.jsonl`` with
absolute image paths.

Steps:

1. Held-out exact-answer accuracy of the toy (greedy, 12 tokens).
2. LoRA on the toy with the pin's CLI: ``python -m mlx_vlm.train`` on 0.7.x, else
   ``python -m mlx_vlm.lora``. Completion-only loss and batch size 1, in a fresh interpreter with
   ``COMPASS_COMPAT_AUTOPATCH=1``.
3. The same accuracy with ``load(..., adapter_path=)``.

It prints and writes (``--out``) the accuracy before and after, the loss curve the trainer
reported, the training time and the adapter's size. The defaults are sized for a few minutes on
a 2-core CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence

from compass_data import shapes
from compass_data.toy import ensure_default_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[2]
QUESTION = "Which shape is the largest?"
TRAIN_SEED, HELD_OUT_SEED = 1001, 1002
MARGIN = 1.2  # the largest shape's side over the next one's, at least


def answer(scene: shapes.Scene) -> Optional[str]:
    """ "The <colour> <kind>." for the scene's largest shape, or None when it is not clearly largest."""
    sides = sorted(scene.shapes, key=lambda s: s.side, reverse=True)
    if len(sides) < 2 or sides[0].side < MARGIN * sides[1].side:
        return None
    return f"The {sides[0].colour} {sides[0].kind}."


def pictures(seed: int, count: int, folder: pathlib.Path) -> List[dict]:
    """``count`` rows: picture path (written as PNG) and answer, from ``seed``."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rows, i = [], 0
    for ex in shapes.examples(seed, 20 * count, varied=False):
        text = answer(ex.scene)
        if text is None:
            continue
        path = folder / f"{seed}-{ex.index}.png"
        Image.fromarray(ex.pixels()).save(path)
        rows.append({"image": str(path), "answer": text})
        i += 1
        if i == count:
            return rows
    raise SystemExit(f"seed {seed} gave only {i} usable pictures of {count}")


def write_split(rows: List[dict], path: pathlib.Path) -> None:
    lines = []
    for r in rows:
        messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": r["answer"]}]
        lines.append(json.dumps({"images": [r["image"]], "messages": messages}) + "\n")
    path.write_text("".join(lines), encoding="utf-8")


def accuracy(model_path: pathlib.Path, rows: List[dict], adapter: Optional[pathlib.Path] = None) -> dict:
    """Exact greedy answers of the checkpoint (with ``adapter``) on ``rows``."""
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template

    import compass_compat  # noqa: F401  (applies the patch)

    model, processor = load(str(model_path), adapter_path=str(adapter) if adapter else None)
    prompt = apply_chat_template(processor, model.config, QUESTION, num_images=1)
    right, answers = 0, []
    for r in rows:
        out = generate(model, processor, prompt, image=[r["image"]], max_tokens=12, temperature=0.0, verbose=False)
        text = (out.text if hasattr(out, "text") else out).strip()
        answers.append(text)
        right += text == r["answer"]
    return {"exact": right / len(rows), "right": right, "of": len(rows), "first_answers": answers[:5]}


def train(model_path: pathlib.Path, data: pathlib.Path, out: pathlib.Path, args) -> dict:
    new = importlib.util.find_spec("mlx_vlm.train") is not None
    common = ["--iters", str(args.iters), "--batch-size", "1", "--learning-rate", str(args.learning_rate)]
    common += ["--steps-per-report", "20", "--train-on-completions", "--output-path", str(out)]
    if args.train_vision:
        common.append("--train-vision")
    if new:
        cmd = ["-m", "mlx_vlm.train", "--model", str(model_path), "--data", str(data), "--steps-per-eval", "100000"]
    else:
        cmd = ["-m", "mlx_vlm.lora", "--model-path", str(model_path), "--dataset", str(data), "--assistant-id", "506"]
    paths = [str(ROOT)] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, COMPASS_COMPAT_AUTOPATCH="1", PYTHONPATH=os.pathsep.join(paths))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *cmd, *common], env=env, capture_output=True, text=True, cwd=out.parent)
    seconds = time.perf_counter() - start
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"training failed:\n{text[-3000:]}")
    curve = [
        (int(it), float(loss))
        for it, loss in re.findall(r"Iter (\d+): Train loss\s*(?:\x1b\[[0-9;]*m)?([0-9.]+)", text)
        + re.findall(r"optimizer_step=(\d+), train_loss=([0-9.]+)", text)
    ]
    size = sum(p.stat().st_size for p in out.glob("adapters.safetensors"))
    return {
        "command": "python " + " ".join(cmd + common),
        "seconds": round(seconds, 1),
        "loss_curve": curve,
        "adapter_bytes": size,
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=600)
    parser.add_argument("--train", type=int, default=400, help="training pictures")
    parser.add_argument("--held-out", type=int, default=60, help="held-out pictures")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--train-vision", action="store_true", help="also train the vision tower")
    parser.add_argument("--out", type=pathlib.Path, help="write the record as JSON here")
    args = parser.parse_args(argv)
    import mlx_vlm

    toy = ensure_default_checkpoint()
    with tempfile.TemporaryDirectory(prefix="compass-learn-") as tmp:
        work = pathlib.Path(tmp)
        train_rows = pictures(TRAIN_SEED, args.train, work / "images")
        held_out = pictures(HELD_OUT_SEED, args.held_out, work / "images")
        data = work / "data"
        data.mkdir()
        write_split(train_rows, data / "train.jsonl")
        write_split(held_out[:8], data / "valid.jsonl")
        before = accuracy(toy, held_out)
        print(f"before: {before['right']}/{before['of']} exact, e.g. {before['first_answers'][:3]}", flush=True)
        run = train(toy, data, work / "adapters", args)
        after = accuracy(toy, held_out, work / "adapters")
        print(f"after: {after['right']}/{after['of']} exact, e.g. {after['first_answers'][:3]}", flush=True)
    record = {
        "mlx_vlm": mlx_vlm.__version__,
        "question": QUESTION,
        "train_pictures": args.train,
        "held_out_pictures": args.held_out,
        "iters": args.iters,
        "learning_rate": args.learning_rate,
        "train_vision": args.train_vision,
        "before": before,
        "after": after,
        **run,
    }
    print(
        f"training {run['seconds']} s, adapter {run['adapter_bytes']} bytes, loss {run['loss_curve'][:1]} -> {run['loss_curve'][-1:]}"
    )
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
