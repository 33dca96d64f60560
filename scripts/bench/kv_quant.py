"""KV-cache quantization on the default (toy) checkpoint: accuracy and agreement with float.

Every question of tests/fixtures/toy_reference.json's test pictures (held out from training,
``--pictures`` per size bucket and renderer), asked through mlx-vlm's own ``stream_generate``
(greedy) with the KV cache float, uniform 8 and 4 bits (``kv_bits``, at each ``--group-sizes``:
mlx-vlm's default 64, the toy's head_dim, and 32), and
TurboQuant 4, 3.5 and 3 bits (``kv_quant_scheme="turboquant"`` where the pin has it), the
quantized cache live from the first token (``quantized_kv_start=0``). Prints per setting: exact
answers right (describe, count, colour), boxes with IoU >= 0.5, and answers equal to
transformers' recorded greedy answer (float, the reference), worded answers and boxes apart. A
setting the pin or MLX refuses prints the refusal.

    PYTHONPATH=. COMPASS_COMPAT_FORCE_VENDORED=1 .venvs/mlxvlm-0.7.10/bin/python scripts/bench/kv_quant.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[2]

TURBOQUANT: Dict[str, dict] = {
    "turboquant 4": {"kv_bits": 4, "kv_quant_scheme": "turboquant"},
    "turboquant 3.5": {"kv_bits": 3.5, "kv_quant_scheme": "turboquant"},
    "turboquant 3": {"kv_bits": 3, "kv_quant_scheme": "turboquant"},
}


def settings(group_sizes: Sequence[int]) -> Dict[str, dict]:
    """Float, uniform 8 and 4 bits at each group size, then TurboQuant."""
    out: Dict[str, dict] = {"float": {}}
    for group in group_sizes:
        for bits in (8, 4):
            out[f"uniform {bits} (group {group})"] = {"kv_bits": bits, "kv_group_size": group}
    return {**out, **TURBOQUANT}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pictures", type=int, default=10, help="test pictures per bucket and renderer (max 10)")
    parser.add_argument(
        "--group-sizes",
        type=int,
        nargs="+",
        default=[64, 32],
        help="kv_group_size of the uniform settings (default: mlx-vlm's default 64, the toy's head_dim, and 32)",
    )
    parser.add_argument("--json", type=pathlib.Path, help="also write the figures here")
    args = parser.parse_args(argv)
    measured = settings(args.group_sizes)

    from PIL import Image

    import compass_compat  # noqa: F401  (applies the patch)
    from compass_data import boxes, shapes, toy
    from scripts._lib import mlx_vlm_run

    reference = json.loads((ROOT / "tests" / "fixtures" / "toy_reference.json").read_text())
    folder = str(toy.ensure_default_checkpoint())
    loaded = mlx_vlm_run.load(folder)
    tokenizer = loaded[1].tokenizer
    turbo = importlib.util.find_spec("mlx_vlm.turboquant") is not None
    tmp = pathlib.Path(tempfile.mkdtemp())
    wanted = {(e["bucket"], e["renderer"], e["index"]): e["answers"] for e in reference["pictures"]}
    seeds = {(e["bucket"], e["renderer"]): e["seed"] for e in reference["pictures"]}

    counts: Dict[str, Dict[str, List[int]]] = {}
    refused: Dict[str, str] = {}
    for (bucket, renderer), seed in seeds.items():
        examples = shapes.examples(
            seed, reference["test_pictures_per_bucket_and_renderer"], bucket=shapes.BUCKETS[bucket], renderer=renderer
        )
        for example in examples[: args.pictures]:
            path = tmp / f"{bucket}_{renderer}_{example.index}.png"
            Image.fromarray(example.pixels()).save(path)
            recorded = wanted[(bucket, renderer, example.index)]
            for kind, q in example.questions.items():
                prompt = mlx_vlm_run.chat_prompt(loaded, q.prompt, 1)
                for name, kwargs in measured.items():
                    if name in refused:
                        continue
                    if kwargs.get("kv_quant_scheme") == "turboquant" and not turbo:
                        refused[name] = "this mlx-vlm has no mlx_vlm.turboquant"
                        continue
                    extra = dict(kwargs, quantized_kv_start=0) if kwargs else {}
                    try:
                        ids = mlx_vlm_run.greedy_ids(loaded, prompt, [path], reference["max_new_tokens"], **extra)
                    except (ValueError, NotImplementedError, TypeError) as err:
                        refused[name] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
                        continue
                    text = tokenizer.decode(ids, skip_special_tokens=True).strip()
                    if kind == "where":
                        found = boxes.find_boxes(text)
                        right = bool(found) and (
                            boxes.iou(boxes.to_pixels(found[0], example.scene.size), shapes.pixel_box(q.subject)) >= 0.5
                        )
                    else:
                        right = text == q.answer
                    row = counts.setdefault(
                        name,
                        {"exact": [0, 0], "boxes": [0, 0], "worded as reference": [0, 0], "boxes as reference": [0, 0]},
                    )
                    for cell, hit in (
                        (row["boxes" if kind == "where" else "exact"], right),
                        (
                            row["boxes as reference" if kind == "where" else "worded as reference"],
                            text == recorded[kind]["text"],
                        ),
                    ):
                        cell[0] += int(hit)
                        cell[1] += 1
        print(f"{bucket} {renderer} done", file=sys.stderr, flush=True)

    import mlx_vlm

    print(f"mlx-vlm {mlx_vlm.__version__}, default checkpoint, quantized_kv_start=0, {args.pictures} pictures per cell")
    print(
        "| KV cache | exact answers right | boxes IoU >= 0.5 | worded answer = transformers' (float) "
        "| box = transformers' (float) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name in measured:
        if name in refused:
            print(f"| {name} | refused: {refused[name]} | | | |")
            continue
        row = counts[name]
        print(f"| {name} | " + " | ".join(f"{a}/{b} ({100 * a / b:.1f}%)" for a, b in row.values()) + " |")
    if args.json:
        args.json.write_text(json.dumps({"counts": counts, "refused": refused}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
