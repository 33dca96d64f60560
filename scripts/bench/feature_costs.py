"""What two mlx-vlm features cost on the full-size stand-in: ours against upstream's cohere_compass.

1. The vision-feature cache through mlx-vlm's own server: time to first token (streamed, measured by
   the client) for a picture sent the first time (miss) and again (hit), a short question.
2. KV-cache quantization: the prompt cache's bytes after a long text prompt, and decode tokens per
   second, float against uniform 8 and 4 bits (``kv_group_size`` 64, ``quantized_kv_start=0``).

Each implementation runs in its own processes (``COMPASS_COMPAT_IMPLEMENTATION=vendored`` or
``upstream``), on the stand-in built by scripts/bench/build_fullsize.py (random weights, the published architecture):

    PYTHONPATH=. .venvs/mlxvlm-0.7.10/bin/python scripts/bench/feature_costs.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[2]
PICTURE = ROOT / "tests" / "fixtures" / "images" / "synth_320x256.png"  # 80 image tokens
QUESTION = "Describe this picture."
SETTINGS = {
    "float": {},
    "uniform 8": {"kv_bits": 8, "kv_group_size": 64},
    "uniform 4": {"kv_bits": 4, "kv_group_size": 64},
}
IMPLS = ("ours", "upstream")


def _env(impl: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "COMPASS_COMPAT_FORCE_VENDORED"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["COMPASS_COMPAT_IMPLEMENTATION"] = "vendored" if impl == "ours" else "upstream"
    return env


def _cache_bytes(cache: List[object]) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    total = 0
    for c in cache:
        state = c.state if not isinstance(c.state, mx.array) else [c.state]
        total += sum(a.nbytes for _, a in tree_flatten(state) if isinstance(a, mx.array))
    return total


def kv_worker(model_dir: str, prompt_tokens: int, max_tokens: int) -> Dict[str, dict]:
    """In this process (implementation already chosen by the environment): bytes and decode speed."""
    import mlx.core as mx
    from mlx_vlm import load, stream_generate

    import compass_compat  # noqa: F401  (the patch; forced when the environment says so)

    model, processor = load(model_dir)
    tokenizer = processor.tokenizer
    sentence = "The quick brown fox jumps over the lazy dog near the river bank. "
    text = sentence * (prompt_tokens // max(1, len(tokenizer.encode(sentence, add_special_tokens=False))) + 1)
    ids = tokenizer.encode(text, add_special_tokens=False)[:prompt_tokens]
    messages = [{"role": "user", "content": [{"type": "text", "text": tokenizer.decode(ids)}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # Random weights pick vocabulary-padding ids (no tokenizer entry), which upstream's detokenizer
    # cannot look up (IndexError); both implementations decode with those ids masked, alike.
    entries = len(tokenizer)

    def real_ids_only(tokens: mx.array, logits: mx.array) -> mx.array:
        return mx.where(mx.arange(logits.shape[-1]) < entries, logits, -mx.inf)

    out = {}
    for name, kv in SETTINGS.items():
        cache = model.language_model.make_cache()
        last = None
        try:
            for last in stream_generate(
                model,
                processor,
                prompt,
                max_tokens=max_tokens,
                temperature=0.0,
                prompt_cache=cache,
                logits_processors=[real_ids_only],
                **({"quantized_kv_start": 0, **kv} if kv else {}),
            ):
                pass
        except Exception as e:  # a setting one implementation refuses is a figure too
            out[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        out[name] = {
            "cache_bytes": _cache_bytes(cache),
            "prompt_tokens": last.prompt_tokens,
            "decode_tps": round(last.generation_tps, 2),
            "cache_types": sorted({type(c).__name__ for c in cache}),
        }
    return out


def _stream_ttft(port: int, model_dir: str, picture: pathlib.Path, max_tokens: int) -> float:
    body = {
        "model": model_dir,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": str(picture)}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=900) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if line.startswith("data:") and '"content"' in line and '"content": ""' not in line:
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def server_ttft(model_dir: str, impl: str, sends: int, log: pathlib.Path) -> List[float]:
    """Start mlx-vlm's server (through compass_compat's launcher) and time ``sends`` identical requests."""
    sys.path.insert(0, str(ROOT))
    from scripts._lib.server import Server

    force = {"COMPASS_COMPAT_IMPLEMENTATION": "vendored" if impl == "ours" else "upstream"}
    with Server(pathlib.Path(model_dir), log, env=force) as server:
        return [_stream_ttft(server.port, model_dir, PICTURE, 4) for _ in range(sends)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="the stand-in folder (default: build_fullsize's bf16 cache)")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="long prompt length (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=8, help="decoded tokens per run (default: %(default)s)")
    parser.add_argument("--sends", type=int, default=2, help="times the picture is sent (default: %(default)s)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the figures here")
    parser.add_argument("--worker", choices=["kv"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model is None:
        from scripts.bench import build_fullsize

        args.model = str(build_fullsize.ensure_checkpoint("bf16"))
    if args.worker == "kv":
        print("KV-JSON " + json.dumps(kv_worker(args.model, args.prompt_tokens, args.max_tokens)))
        return 0
    figures: Dict[str, dict] = {}
    logs = ROOT / "build" / "feature_costs"
    logs.mkdir(parents=True, exist_ok=True)
    for impl in IMPLS:
        times = server_ttft(args.model, impl, args.sends, logs / f"server-{impl}.log")
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "kv",
            "--model",
            args.model,
            "--prompt-tokens",
            str(args.prompt_tokens),
        ]
        cmd += ["--max-tokens", str(args.max_tokens)]
        run = subprocess.run(cmd, capture_output=True, text=True, env=_env(impl), cwd=str(ROOT))
        line = next((x for x in run.stdout.splitlines() if x.startswith("KV-JSON ")), None)
        if line is None:
            raise RuntimeError(f"kv worker ({impl}) failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
        figures[impl] = {"ttft_s": [round(t, 2) for t in times], "kv": json.loads(line[len("KV-JSON ") :])}
        print(f"{impl} done", file=sys.stderr, flush=True)
    print(
        f"picture {PICTURE.name}, {args.sends} sends; prompt {args.prompt_tokens} text tokens, {args.max_tokens} decoded"
    )
    print("| model | first send (miss) | later sends (hit), median | hit / miss |")
    print("| --- | --- | --- | --- |")
    for impl, f in figures.items():
        miss, hits = f["ttft_s"][0], statistics.median(f["ttft_s"][1:])
        print(f"| {impl} | {miss:.2f} s | {hits:.2f} s | {hits / miss:.2f} |")
    print()
    print("| model | KV cache | cache bytes (prompt + decoded) | decode tokens/s |")
    print("| --- | --- | --- | --- |")
    for impl, f in figures.items():
        for name, row in f["kv"].items():
            if "error" in row:
                print(f"| {impl} | {name} | {row['error']} | - |")
                continue
            print(f"| {impl} | {name} | {row['cache_bytes'] / 2**20:.1f} MiB | {row['decode_tps']} |")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
