"""The scheduled soak of mlx-vlm's own server on mixed batches (issue 43): random batches of text,
picture, video and follow-up requests sent behind a request with a long prefill, each answer
checked against the same request alone, until every combination of what a batch holds x where
its prefill was cut x the prefix cache has been seen (the full cross product) and at least
``--requests`` requests went out, or ``--minutes`` ran out.

Usage (in a pin's environment, from the repository root):
    .venvs/mlxvlm-0.6.12/bin/python -m scripts.hosts.common.mixed_soak [--requests 300] [--minutes 40]
        [--seed 0] [--out build/hosts/mixed_soak-<pin>.md]
The vendored package is live on every pin (0.7.10: by the recorded verdicts). Exit 1 if any
request answered otherwise than alone (or with an error), or a combination was never seen.
The cut of each batch is what the server's model saw (the hosts' probe trace), not what was
planned; the per-case check in CI is tests/test_mixed_batches.py.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import random
import sys
import tempfile
import time
from collections import Counter
from typing import List, Tuple

from tests.support.mixed_batches import (
    BIG,
    CUTS,
    HOLDS,
    PREFIXES,
    SMALL,
    VIDEO,
    Answers,
    Ask,
    ask,
    picture,
    run_batch,
    running,
    say,
    text,
)
from tests.support.server import VERSION, serving

PICTURES = (SMALL, BIG, "synth_448x448_b.png", "synth_501x379.png")
# The cached first turn's picture, never in a later turn: a conversation showing one file in two
# turns is answered 500 on 0.6.12 alone too (2 placeholders, 1 image), not a batching matter.
PREFIX_PICTURE = "synth_256x320.png"
IMPOSSIBLE = {("text", "inside", p) for p in PREFIXES} | {("text", c, "picture") for c in CUTS}


def _row(rng: random.Random, kind: str, tag: str, lengths: Tuple[int, ...]) -> Ask:
    words = say(text(rng.choice(lengths), tag))
    if kind == "text":
        return ask(words)
    if kind == "video":
        return ask(VIDEO, words)
    return ask(picture(rng.choice(PICTURES)), words)


def _batch(rng: random.Random, n: int) -> Tuple[str, Tuple[Ask, ...], Tuple[Ask, ...]]:
    """(prefix kind, rows, warm-up requests) of one random batch; ``n`` makes its texts its own."""
    kinds = rng.choice((["text"], ["picture"], ["text", "picture"], ["text", "picture", "video"], ["video", "text"]))
    lengths = rng.choice(((4, 8), (4, 12, 40, 120, 260), (120, 260)))  # short rows fit one chunk
    rows = [_row(rng, rng.choice(kinds), f"s{n}r{i}", lengths) for i in range(rng.randint(2, 4))]
    prefix = rng.choice(PREFIXES)
    warm: Tuple[Ask, ...] = ()
    if prefix != "none":
        first = (
            ask(picture(PREFIX_PICTURE), say(f"s{n}: what is this?"))
            if prefix == "picture"
            else ask(say(text(60, f"s{n}p")))
        )
        warm = (first,)
        # Its own turn after the cached one; never a video: a conversation with a video in any
        # turn is refused by the processor through mlx-vlm's chat formatting (docs/features.md).
        turn = rows[0] if rows[0].content()[0]["type"] != "video" else ask(say(f"s{n}: and then?"))
        rows[0] = ask(*turn.content(), after=first)
    return prefix, tuple(rows), warm


def _holds(rows: Tuple[Ask, ...]) -> str:
    def kind(row: Ask) -> str:
        parts = [p for r in _turns(row) for p in r.content()]
        if any(p["type"] == "video" for p in parts):
            return "video"
        return "picture" if any(p["type"] == "image_url" for p in parts) else "text"

    kinds = {kind(r) for r in rows}
    if "video" in kinds:
        return "video"
    if kinds == {"text"}:
        return "text"
    return "pictures" if kinds == {"picture"} else "mixed"


def _turns(row: Ask) -> List[Ask]:
    return ([] if row.after is None else _turns(row.after)) + [row]


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="at least this many requests (default 300)")
    parser.add_argument("--minutes", type=float, default=40, help="stop after this long (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(f"build/hosts/mixed_soak-{VERSION}.md"))
    args = parser.parse_args(argv)
    from compass_data.tiny import build_tiny_checkpoint
    from tests.support.mixed_batches import start

    rng = random.Random(args.seed)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="mixed_soak-"))
    checkpoint = build_tiny_checkpoint(folder / "tiny", layout="original")
    apc = {"APC_ENABLED": "1", "APC_BLOCK_SIZE": "16"}
    # Two prefill steps: 128 cuts most batches (inside and outside pictures); 512 leaves a batch
    # with a picture or a cached picture turn in one chunk.
    started = {
        f"{name}-{step}": start(checkpoint, folder, f"{name}-{step}", env, step)
        for name, env in (("plain", {}), ("cached", apc))
        for step in (128, 512)
    }
    seen: Counter = Counter()
    wrong: List[str] = []
    pins: List[str] = []  # answered otherwise where the pin is known wrong (below), not the model
    from tests.support.batch_server import pin_samples_a_padding_column

    samples_padding = pin_samples_a_padding_column()
    sent = batches = 0
    deadline = time.monotonic() + 60 * args.minutes
    wanted = {c for c in itertools.product(HOLDS, CUTS, PREFIXES) if c not in IMPOSSIBLE}
    with serving(started) as servers:
        alone = Answers(servers["plain-128"])
        while time.monotonic() < deadline and (sent < args.requests or not wanted <= set(seen)):
            prefix, rows, warm = _batch(rng, batches)
            server = servers[f"{'plain' if prefix == 'none' else 'cached'}-{rng.choice((128, 512))}"]
            outcome = run_batch(server, alone, running(f"soak{batches}"), rows, warm)
            holds = _holds(rows)
            for cut in outcome.cuts or {"not batched"}:
                seen[(holds, cut, prefix)] += 1
            batches += 1
            sent += len(rows) + 1 + len(warm)
            if not outcome.as_alone:
                pin_wrong = outcome.one_column_chunk or (samples_padding and outcome.restored_row_cut)
                (pins if pin_wrong else wrong).append(
                    f"batch {batches} ({holds}, {sorted(outcome.cuts)}, prefix {prefix}): {outcome.got} != {outcome.want}"
                )
            print(
                f"[mixed-soak] batch {batches}: {holds}, cuts {sorted(outcome.cuts)}, prefix {prefix}: "
                f"{'as alone' if outcome.as_alone else 'DIFFERS'} ({sent} requests)",
                flush=True,
            )
    missing = sorted(wanted - set(seen))
    lines = [
        f"# Mixed-batch soak: mlx-vlm {VERSION}",
        "",
        f"`python -m scripts.hosts.common.mixed_soak --requests {args.requests} --minutes {args.minutes} "
        f"--seed {args.seed}`: {batches} batches, {sent} requests (warm-ups and the running request included), "
        f"{len(wrong)} batches with an answer other than alone; {len(pins)} more answered otherwise where the pin "
        "is known wrong (docs/hosts.md): a one-column prefill chunk (mlx-lm's BatchRotatingKVCache), or a "
        "row restored from the prefix cache in a prefill cut into chunks (0.6.12 reads it from padding).",
        "",
        "| holds | cut | prefix cache | batches |",
        "| --- | --- | --- | --- |",
        *[f"| {h} | {c} | {p} | {seen.get((h, c, p), 0)} |" for h, c, p in sorted(wanted)],
        "",
        *(f"- {w}" for w in wrong),
        *(f"- the pin's: {w}" for w in pins),
        *(f"- never seen: {m}" for m in missing),
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 1 if wrong or missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
