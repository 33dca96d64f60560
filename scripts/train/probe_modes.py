"""Run each training mode of the installed mlx-vlm's own trainer CLI for a few steps on the tiny checkpoint.

    COMPASS_COMPAT_AUTOPATCH=1 [COMPASS_COMPAT_FORCE_VENDORED=1] PYTHONPATH=. \\
        .venvs/mlxvlm-<pin>/bin/python scripts/train/probe_modes.py [--modes lora full ...] [--out modes.json]

The CLI is probed, not the version: ``python -m mlx_vlm.train`` (0.7.x) where it exists, else
``python -m mlx_vlm.lora`` (0.4.x-0.6.x; it needs the ``datasets`` package, mlx-vlm's ``train``
extra). A mode whose flag the CLI does not have is reported as such without running. Every run is
a fresh interpreter with ``COMPASS_COMPAT_AUTOPATCH=1`` (the CLI imports mlx-vlm, not
compass_compat), ``--iters 3 --batch-size 1`` on a dataset of 4 shape pictures written to a
temporary folder (absolute image paths: 0.6.x opens them from the working directory). Prints a
markdown table: mode, result (ok: exit 0 and the adapter or weights file written; else the last
error line), first and last reported loss, seconds.
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
from typing import Dict, List, Optional, Sequence

from compass_data import shapes
from compass_data.tiny import build_tiny_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[2]
ITERS = 3
NEW_CLI, OLD_CLI = "mlx_vlm.train", "mlx_vlm.lora"
# mode -> (extra flags per CLI, dataset kind, model): None = the CLI has no such mode.
MODES: Dict[str, dict] = {
    "lora": {NEW_CLI: [], OLD_CLI: []},
    "full": {NEW_CLI: ["--train-type", "full"], OLD_CLI: ["--full-finetune"]},
    "train-vision": {NEW_CLI: ["--train-vision"], OLD_CLI: ["--train-vision"]},
    "grad-checkpoint": {NEW_CLI: ["--grad-checkpoint"], OLD_CLI: ["--grad-checkpoint"]},
    "completions": {
        NEW_CLI: ["--train-on-completions", "--assistant-id", "{assistant_id}"],
        OLD_CLI: ["--train-on-completions", "--assistant-id", "{assistant_id}"],
    },
    "dora": {NEW_CLI: ["--train-type", "dora"], OLD_CLI: None},
    "qlora-from-float": {NEW_CLI: ["--quantization-bits", "4", "--quantization-group-size", "32"], OLD_CLI: None},
    "qlora-4bit-conversion": {NEW_CLI: [], OLD_CLI: [], "model": "q4"},
    "target-modules": {NEW_CLI: ["--target-modules", "q_proj", "v_proj"], OLD_CLI: None},
    "compile": {NEW_CLI: ["--compile"], OLD_CLI: None},
    "orpo": {NEW_CLI: ["--algorithm", "orpo"], OLD_CLI: ["--train-mode", "orpo"], "data": "preference"},
    "dpo": {NEW_CLI: ["--algorithm", "dpo"], OLD_CLI: None, "data": "preference"},
    # Two samples of at most 8 tokens per prompt: the tiny model rarely stops, so the defaults
    # (4 samples of up to 512) make 3 steps take minutes of sampling.
    "grpo": {
        NEW_CLI: ["--algorithm", "grpo", "--group-size", "2", "--max-completion-length", "8"],
        OLD_CLI: None,
        "data": "grpo",
    },
}


def cli() -> str:
    return NEW_CLI if importlib.util.find_spec(NEW_CLI) else OLD_CLI


def write_datasets(root: pathlib.Path, count: int = 4) -> Dict[str, pathlib.Path]:
    """SFT, preference and GRPO rows (JSONL train/valid splits) about ``count`` shape pictures."""
    from PIL import Image

    images = root / "images"
    images.mkdir(parents=True)
    sft, pref, grpo = [], [], []
    for ex in shapes.examples(shapes.TRAIN_SEED, count, varied=False):
        path = images / f"{ex.index}.png"
        Image.fromarray(ex.pixels()).save(path)
        q = ex.questions["count"]
        user = {"role": "user", "content": q.prompt}
        sft.append({"images": [str(path)], "messages": [user, {"role": "assistant", "content": q.answer}]})
        wrong = "Nothing."
        pref.append(
            {
                "images": [str(path)],
                "chosen": [user, {"role": "assistant", "content": q.answer}],
                "rejected": [user, {"role": "assistant", "content": wrong}],
            }
        )
        grpo.append({"images": [str(path)], "prompt": q.prompt, "answer": q.answer})
    out = {}
    for kind, rows in (("sft", sft), ("preference", pref), ("grpo", grpo)):
        folder = root / kind
        folder.mkdir()
        for split in ("train", "valid"):
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        out[kind] = folder
    return out


def quantize(source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    code = (
        "import sys, compass_compat; from mlx_vlm.convert import convert; "
        "convert(sys.argv[1], mlx_path=sys.argv[2], quantize=True, q_bits=4, q_group_size=32)"
    )
    subprocess.run([sys.executable, "-c", code, str(source), str(out)], check=True, capture_output=True, cwd=ROOT)
    return out


def command(name: str, model: pathlib.Path, data: pathlib.Path, out: pathlib.Path, assistant_id: int) -> List[str]:
    flags = [f.format(assistant_id=assistant_id) for f in MODES[name][cli()]]
    common = ["--iters", str(ITERS), "--batch-size", "1", "--steps-per-report", "1", "--output-path", str(out)]
    if cli() == NEW_CLI:
        return ["--model", str(model), "--data", str(data), "--steps-per-eval", "1000", *common, *flags]
    return ["--model-path", str(model), "--dataset", str(data), *common, *flags]


def run_mode(name: str, models: Dict[str, pathlib.Path], data: Dict[str, pathlib.Path], work: pathlib.Path) -> dict:
    spec = MODES[name]
    if spec[cli()] is None:
        return {"mode": name, "result": f"no such mode in `python -m {cli()}`"}
    out = work / f"out-{name}"
    args = command(name, models[spec.get("model", "float")], data[spec.get("data", "sft")], out, models["assistant_id"])
    # This tree's code first; the runs' working directory is the temporary folder.
    paths = [str(ROOT)] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, COMPASS_COMPAT_AUTOPATCH="1", PYTHONPATH=os.pathsep.join(paths))
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", cli(), *args], env=env, cwd=work, capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired:
        return {"mode": name, "result": "timed out after 600 s", "seconds": 600}
    seconds = round(time.perf_counter() - start, 1)
    text = proc.stdout + proc.stderr
    losses = [float(x) for x in re.findall(r"(?:Train loss\s*(?:\x1b\[[0-9;]*m)?|loss=)([0-9.]+)", text)]
    written = any(out.rglob("*.safetensors")) if out.exists() else False
    if proc.returncode == 0 and written:
        result = "ok"
    else:
        errors = [line for line in text.splitlines() if re.search(r"(Error|Exception)\b", line)]
        result = (errors[-1] if errors else f"exit {proc.returncode}, no weights written").strip()[:300]
    return {
        "mode": name,
        "result": result,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "seconds": seconds,
        "command": f"python -m {cli()} " + " ".join(args),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--out", type=pathlib.Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    import mlx_vlm

    with tempfile.TemporaryDirectory(prefix="compass-train-probe-") as tmp:
        work = pathlib.Path(tmp)
        models = {"float": build_tiny_checkpoint(work / "tiny")}
        if any(MODES[m].get("model") == "q4" for m in args.modes):
            models["q4"] = quantize(models["float"], work / "tiny-q4")
        from transformers import AutoTokenizer

        models["assistant_id"] = AutoTokenizer.from_pretrained(models["float"]).convert_tokens_to_ids(
            "<|CHATBOT_TOKEN|>"
        )
        data = write_datasets(work / "data")
        rows = []
        for name in args.modes:
            rows.append(run_mode(name, models, data, work))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"mlx-vlm {mlx_vlm.__version__}, `python -m {cli()}`, {ITERS} steps on the tiny checkpoint\n")
    print("| mode | result | loss first -> last | s |\n| ---- | ------ | ------------------ | - |")
    for r in rows:
        loss = f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}" if r.get("loss_first") is not None else ""
        print(f"| {r['mode']} | {r['result']} | {loss} | {r.get('seconds', '')} |")
    if args.out:
        args.out.write_text(json.dumps({"mlx_vlm": mlx_vlm.__version__, "rows": rows}, indent=1) + "\n")
    return 0 if all(r["result"] == "ok" or r["result"].startswith("no such mode") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
