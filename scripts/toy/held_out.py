"""Held-out figures per size bucket x renderer for a toy checkpoint's weights: transformers'
greedy answers (``train_toy.greedy`` / ``train_toy.score``) on 40 pictures per cell from each
of the seeds [2, b, r] and [5, b, r] (80 per cell; training never used either, neither is the
test seed). Stages are chosen on these figures; the boxes are also reported for the elongated
pictures alone (one side at least twice the other).

    .venvs/mlxvlm-0.7.10/bin/python scripts/toy/held_out.py WEIGHTS_DIR OUT.json [--cells 320-448:pil ...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from typing import Optional, Sequence

from scripts.toy import train as tt
from tests.support import reference as _reference

SEEDS = (2, 5)
PER_SEED = 40


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("weights", type=pathlib.Path, help="a folder holding the toy's model.safetensors")
    parser.add_argument("out", type=pathlib.Path, help="write the figures and every answer here (JSON)")
    parser.add_argument("--cells", nargs="+", metavar="BUCKET:RENDERER", help="only these cells")
    args = parser.parse_args(argv)
    only = {tuple(c.split(":")) for c in args.cells} if args.cells else None
    shapes = tt.shapes
    torch = _reference.deterministic_torch()
    model, ref = tt.load_trained(args.weights)
    figures: dict = {}
    elongated: dict = {}
    answers_out: dict = {}
    start = time.time()
    with torch.no_grad():
        for b, bucket in enumerate(shapes.BUCKETS):
            for r, renderer in enumerate(shapes.RENDERERS):
                if only is not None and (bucket, renderer) not in only:
                    continue
                answers, long_hits = [], []
                for seed in SEEDS:
                    for example in shapes.examples(
                        [seed, b, r], PER_SEED, bucket=shapes.BUCKETS[bucket], renderer=renderer
                    ):
                        pixels = example.pixels()
                        for kind, q in example.questions.items():
                            text = tt.decode(ref, tt.greedy(model, ref, q.prompt, pixels))
                            answers.append((example, kind, text))
                            answers_out.setdefault(f"{bucket} {renderer}", []).append([seed, example.index, kind, text])
                            if kind == "where" and tt.is_elongated(example.scene.size):
                                long_hits.append(tt.box_hit(text, q, example.scene.size))
                scored = tt.score(answers)[bucket]
                figures.setdefault(renderer, {})[bucket] = scored
                elongated.setdefault(renderer, {})[bucket] = f"{sum(long_hits)}/{len(long_hits)}"
                print(
                    f"{bucket} {renderer} {json.dumps(scored)} elongated boxes {sum(long_hits)}/{len(long_hits)} "
                    f"({time.time() - start:.0f} s)",
                    flush=True,
                )
    args.out.write_text(
        json.dumps({"held_out_by_bucket": figures, "elongated_boxes": elongated, "answers": answers_out}, indent=1)
        + "\n"
    )


if __name__ == "__main__":
    main()
