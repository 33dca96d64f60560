"""The toy checkpoint's accuracy table on this pin: size bucket x renderer x question kind, float
and 8-bit (affine, group 64), on every test picture of tests/fixtures/toy_reference.json.

tests/test_toy.py asserts the targets on the float answers (and 8-bit on the first pictures of
each bucket and renderer); this prints the whole table, 8-bit included, for README.md:

    PYTHONPATH=. .venvs/mlxvlm-0.6.12/bin/python scripts/toy/accuracy.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]

KINDS = ("describe", "count", "colour", "where")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=pathlib.Path, help="also write the table here")
    args = parser.parse_args(argv)

    from PIL import Image

    from compass_data import shapes, toy
    from scripts.toy.scoring import box_hit
    from tests.support import mlx_vlm_run
    from tests.support.quantize import quantize_folder

    reference = json.loads((ROOT / "tests" / "fixtures" / "toy_reference.json").read_text())
    count = reference["test_pictures_per_bucket_and_renderer"]
    tmp = pathlib.Path(tempfile.mkdtemp())
    mlx = toy.build_toy_checkpoint(tmp / "mlx", layout="mlx")
    folders = {
        "float": toy.build_toy_checkpoint(tmp / "float"),
        "8bit": quantize_folder(mlx, tmp / "q8", "affine", 64, 8),
    }
    seeds = {(e["bucket"], e["renderer"]): e["seed"] for e in reference["pictures"]}
    table: Dict[str, Dict[str, Dict[str, List[bool]]]] = {}
    for (bucket, renderer), seed in seeds.items():
        for example in shapes.examples(seed, count, bucket=shapes.BUCKETS[bucket], renderer=renderer):
            path = tmp / f"{bucket}_{renderer}_{example.index}.png"
            Image.fromarray(example.pixels()).save(path)
            for precision, folder in folders.items():
                _, processor = mlx_vlm_run.load(str(folder))
                for kind, q in example.questions.items():
                    ids = mlx_vlm_run.answer_ids(folder, q.prompt, path, reference["max_new_tokens"])
                    text = processor.tokenizer.decode(ids, skip_special_tokens=True).strip()
                    hit = box_hit(text, q.subject, example.scene.size) if kind == "where" else text == q.answer
                    table.setdefault(precision, {}).setdefault(f"{bucket} {renderer}", {}).setdefault(kind, []).append(
                        hit
                    )
        print(f"{bucket} {renderer} done", file=sys.stderr, flush=True)
    out = {}
    print(
        "| size (longer side) | renderer | precision | describe | count | colour | exact (3 kinds) | boxes IoU >= 0.5 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cell in table["float"]:
        for precision in folders:
            kinds = table[precision][cell]
            exact = [h for k in KINDS[:3] for h in kinds[k]]
            row = {k: float(np.mean(kinds[k])) for k in KINDS} | {"exact": float(np.mean(exact))}
            out[f"{cell} {precision}"] = row
            bucket, renderer = cell.split()
            print(
                f"| {bucket} | {renderer} | {precision} | "
                + " | ".join(f"{100 * row[k]:.0f}%" for k in ("describe", "count", "colour", "exact", "where"))
                + " |"
            )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
