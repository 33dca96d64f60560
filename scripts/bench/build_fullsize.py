"""Build (once) and cache a full-size cohere_compass stand-in checkpoint with random weights.

The benchmark (scripts/bench/fullsize.py) needs the real shapes, not the real values, so this writes a
checkpoint of the issue's dimensions in the MLX-conversion layout (``language_model.model.*``,
``vision_tower.*``, Conv3d as ``[O, T, P, P, C]``), in two variants:

- ``bf16``: every tensor bfloat16 (about 4.9 GB);
- ``4bit``: the same bfloat16 values, affine 4-bit with group size 64, quantized the way
  ``mlx_vlm.convert`` does by default (tests/test_quantized.py pins that convention): every
  text Linear and the token embedding (also the tied head) get ``.weight`` (packed uint32),
  ``.scales`` and ``.biases`` (bfloat16); the vision tower and its mergers stay bfloat16
  (``skip_multimodal_module``); config.json carries
  ``quantization {group_size: 64, bits: 4, mode: affine}`` (about 2.0 GB).

Dimensions (the issue's; vocabulary and intermediate size are the published ones):
text hidden 2048, 28 layers (3 sliding : 1 full), 16 heads, 8 KV heads, head_dim 128,
intermediate 6144 (confirmed), vocab 262144 (as published: 255035 tokenizer entries, the rest
padding rows), tied head, logit_scale 0.25, window 4096, MRoPE [24, 20, 20]
at theta 50000; vision 27 blocks, 1152 wide, MLP 4304, 16 heads, deepstack [8, 16, 24].

Config, tokenizer and chat template come from compass_data.tiny (the tiny tokenizer's ids
are all below the vocabulary; its tokenizer_config.json gets the published pixel bounds); weights are uniform noise from numpy's PCG64, one stream
per tensor, rounded with ``tiny.to_bfloat16_bits`` and streamed to disk tensor by tensor (peak
extra memory is one chunk). A ``stand-in.json`` records what was built; a folder whose record
matches is reused as is.

    .venvs/mlxvlm-0.7.10/bin/python scripts/bench/build_fullsize.py [--variant bf16|4bit|all] [--dir D]

Cache folder: ``$COMPASS_COMPAT_FULLSIZE_DIR`` if set, else ``~/.cache/compass-compat/fullsize``;
the variants go to ``<dir>/bf16`` and ``<dir>/4bit``. Not committed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import pathlib
import shutil
import struct
import time
import zlib
from typing import Dict, Iterator, List, Tuple

import numpy as np

from compass_data import tiny
from compass_data.weight_tree import weight_tree

REPO = pathlib.Path(__file__).resolve().parents[2]

VARIANTS = ("bf16", "4bit")
FORMAT_VERSION = 3  # bump when the weights or config written here change
GROUP_SIZE, BITS = 64, 4

# The tiny checkpoint's dims with the published sizes (patches, merge, norms and logit scale are the same).
TEXT = dict(
    copy.deepcopy(tiny.TEXT),
    hidden_size=2048,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=6144,
    vocab_size=262144,
    sliding_window=4096,
    layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 7,
    max_position_embeddings=8192,
)
ROPE = tiny.mrope_parameters([24, 20, 20])
VISION = dict(
    copy.deepcopy(tiny.VISION),
    depth=27,
    hidden_size=1152,
    num_heads=16,
    intermediate_size=4304,
    out_hidden_size=2048,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)
# The published preprocessor_config.json values (the default tiny checkpoint's).
PREPROCESSOR = tiny.tiny_preprocessor_config()

# The published tokenizer_config.json's min_pixels / max_pixels, which the processor uses.
PUBLISHED_PIXEL_BOUNDS = (16384, 3868706)

CHUNK = 1 << 23  # elements generated at a time


def default_dir() -> pathlib.Path:
    env = os.environ.get("COMPASS_COMPAT_FULLSIZE_DIR")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "compass-compat" / "fullsize"


# --------------------------------------------------------------------------- config
def fullsize_config(variant: str) -> dict:
    """config.json: the tiny checkpoint's (token ids, layout of keys) with full-size dims."""
    config = tiny.strip_test_keys(tiny.tiny_config("default", "bfloat16"))
    text, vision = config["text_config"], config["vision_config"]
    text.update(copy.deepcopy(TEXT), rope_parameters=copy.deepcopy(ROPE), tie_word_embeddings=True)
    vision.update(copy.deepcopy(VISION))
    config["compass_compat_stand_in"] = "random weights, full-size shapes (scripts/bench/build_fullsize.py)"
    if variant == "4bit":
        quant = {"group_size": GROUP_SIZE, "bits": BITS, "mode": "affine"}
        config["quantization"] = dict(quant)
        config["quantization_config"] = dict(quant)
    return config


# --------------------------------------------------------------------------- weights
def weight_specs() -> Iterator[Tuple[str, Tuple[int, ...], str, float, bool]]:
    """(MLX-layout key, shape, kind, std, quantizable) of every tensor of the full-size model,
    from the one weight tree (:func:`compass_data.weight_tree.weight_tree`).

    kind "noise": uniform noise of standard deviation ``std``; "norm": ``1 + noise``.
    ``quantizable``: a text Linear/Embedding weight (mlx-vlm's converter skips the vision tower).
    """
    for key, (shape, kind) in weight_tree(TEXT, VISION, tied=True).items():
        quantizable = key.startswith("language_model.") and kind in ("linear", "embedding")
        yield key, shape, ("norm" if kind == "norm" else "noise"), (0.05 if kind == "norm" else 0.02), quantizable


def bf16_chunks(seed: int, key: str, shape, kind: str, std: float) -> Iterator[np.ndarray]:
    """bfloat16 bit patterns (uint16) of one tensor, whole rows at a time."""
    rng = np.random.default_rng([seed, zlib.crc32(key.encode("utf-8"))])
    row = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
    rows = shape[0] if len(shape) > 1 else 1
    per = max(1, CHUNK // row)
    amp = np.float32(std * math.sqrt(3.0))
    for start in range(0, rows, per):
        n = min(per, rows - start) * row
        u = rng.random(n, dtype=np.float32)
        x = (u * np.float32(2.0) - np.float32(1.0)) * amp
        if kind == "norm":
            x += np.float32(1.0)
        yield tiny.to_bfloat16_bits(x).reshape((-1,) + tuple(shape[1:]) if len(shape) > 1 else (-1,))


def _entries(variant: str) -> List[Tuple[str, str, Tuple[int, ...], int, tuple]]:
    """(key, safetensors dtype, shape, nbytes, spec) of every stored tensor."""
    out = []
    for key, shape, kind, std, quantizable in weight_specs():
        spec = (key, shape, kind, std)
        if variant == "4bit" and quantizable:
            rows, cols = shape
            base = key[: -len(".weight")]
            groups = cols // GROUP_SIZE
            packed = (rows, cols * BITS // 32)
            out.append((key, "U32", packed, 4 * rows * packed[1], spec + ("q",)))
            out.append((base + ".scales", "BF16", (rows, groups), 2 * rows * groups, spec + ("s",)))
            out.append((base + ".biases", "BF16", (rows, groups), 2 * rows * groups, spec + ("b",)))
        else:
            out.append((key, "BF16", tuple(shape), 2 * int(np.prod(shape)), spec + ("w",)))
    return sorted(out, key=lambda e: e[0])


def _quantized_parts(seed: int, spec) -> Dict[str, np.ndarray]:
    import mlx.core as mx

    key, shape, kind, std = spec[:4]
    parts = {"q": [], "s": [], "b": []}
    for bits in bf16_chunks(seed, key, shape, kind, std):
        w = mx.array(bits).view(mx.bfloat16)
        q, s, b = mx.quantize(w, group_size=GROUP_SIZE, bits=BITS)
        mx.eval(q, s, b)
        parts["q"].append(np.array(q))
        parts["s"].append(np.array(s.view(mx.uint16)))
        parts["b"].append(np.array(b.view(mx.uint16)))
    return {k: np.concatenate(v) for k, v in parts.items()}


def _print(*args) -> None:
    print(*args, flush=True)


def write_weights(path: pathlib.Path, variant: str, seed: int = 0, progress=_print) -> int:
    """Stream the weights of ``variant`` into ``path`` (safetensors); returns bytes written."""
    entries = _entries(variant)
    header: Dict[str, object] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for key, dtype, shape, nbytes, _ in entries:
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    total = offset
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    done, next_report, tic = 0, 0.0, time.perf_counter()
    quantized: Dict[str, Dict[str, np.ndarray]] = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, dtype, shape, nbytes, spec in entries:
            part = spec[4]
            if part == "w":
                for chunk in bf16_chunks(seed, *spec[:4]):
                    f.write(np.ascontiguousarray(chunk).tobytes())
            else:
                # .biases / .scales sort before .weight: quantize once, write the three parts.
                if spec[0] not in quantized:
                    quantized[spec[0]] = _quantized_parts(seed, spec)
                data = quantized[spec[0]][part]
                if data.nbytes != nbytes:
                    raise AssertionError(f"{key}: {data.nbytes} bytes, expected {nbytes}")
                f.write(np.ascontiguousarray(data).tobytes())
                if part == "q":
                    del quantized[spec[0]]
            done += nbytes
            if done / total >= next_report or done == total:
                rate = done / max(time.perf_counter() - tic, 1e-9) / 1e6
                progress(
                    f"  [{variant}] {100 * done / total:5.1f}%  {done / 1e9:5.2f}/{total / 1e9:.2f} GB  ({rate:.0f} MB/s)"
                )
                while next_report <= done / total:
                    next_report += 0.05
    return total


def _record(variant: str, seed: int) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "variant": variant,
        "seed": seed,
        "text": TEXT,
        "rope": ROPE,
        "vision": VISION,
        "quantization": {"group_size": GROUP_SIZE, "bits": BITS, "vision": False} if variant == "4bit" else None,
    }


def ensure_checkpoint(variant: str, root=None, seed: int = 0, progress=_print) -> pathlib.Path:
    """Path of the cached ``variant`` checkpoint, building it first if missing or stale."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {list(VARIANTS)}, got {variant!r}")
    folder = pathlib.Path(root or default_dir()) / variant
    marker = folder / "stand-in.json"
    record = _record(variant, seed)
    if marker.exists() and json.loads(marker.read_text()) == json.loads(json.dumps(record)):
        return folder
    progress(f"building the full-size stand-in checkpoint ({variant}) in {folder} ...")
    tic = time.perf_counter()
    if folder.exists():
        shutil.rmtree(folder)
    tmp = folder.with_name(folder.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    def dump(name: str, obj: dict) -> None:
        (tmp / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")

    dump("config.json", fullsize_config(variant))
    dump("preprocessor_config.json", PREPROCESSOR)
    dump("generation_config.json", tiny.tiny_generation_config())
    for name in tiny.TOKENIZER_FILES:
        shutil.copyfile(tiny.TOKENIZER_DIR / name, tmp / name)
    tokenizer_config = tiny.tiny_tokenizer_config()
    tokenizer_config["min_pixels"], tokenizer_config["max_pixels"] = PUBLISHED_PIXEL_BOUNDS
    dump("tokenizer_config.json", tokenizer_config)
    size = write_weights(tmp / "model.safetensors", variant, seed, progress)
    (tmp / "stand-in.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    tmp.rename(folder)
    progress(f"built {folder} ({size / 1e9:.2f} GB) in {time.perf_counter() - tic:.0f} s")
    return folder


def ensure_torch_layout(root=None, seed: int = 0, progress=_print) -> pathlib.Path:
    """The bf16 stand-in in the original (CohereLabs) layout, for transformers' from_pretrained.

    Same bytes as ``<dir>/bf16``, keys renamed with ``tiny.PREFIXES`` and the Conv3d weight
    moved back to torch's ``[O, C, T, P, P]``; written to ``<dir>/bf16-original``.
    """
    source = ensure_checkpoint("bf16", root, seed, progress)
    folder = pathlib.Path(root or default_dir()) / "bf16-original"
    marker = folder / "stand-in.json"
    record = {**_record("bf16", seed), "layout": "original"}
    if marker.exists() and json.loads(marker.read_text()) == json.loads(json.dumps(record)):
        return folder
    progress(f"writing the original-layout copy for transformers in {folder} ...")
    if folder.exists():
        shutil.rmtree(folder)
    tmp = folder.with_name(folder.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("model.safetensors", "stand-in.json"))
    src = source / "model.safetensors"
    with open(src, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
    header.pop("__metadata__", None)
    renamed = {}
    for key, entry in header.items():
        new = key
        for original, mlx in tiny.PREFIXES:
            if key.startswith(mlx):
                new = key.replace(mlx, original, 1)
                break
        renamed[new] = (key, entry)
    out_header: Dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for new in sorted(renamed):
        key, entry = renamed[new]
        start, end = entry["data_offsets"]
        shape = list(entry["shape"])
        if new == tiny.PATCH_EMBED:
            shape = [shape[0], shape[4], shape[1], shape[2], shape[3]]
        out_header[new] = {"dtype": entry["dtype"], "shape": shape, "data_offsets": [offset, offset + end - start]}
        offset += end - start
    blob = json.dumps(out_header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(src, "rb") as fin, open(tmp / "model.safetensors", "wb") as fout:
        fout.write(struct.pack("<Q", len(blob)))
        fout.write(blob)
        for new in sorted(renamed):
            key, entry = renamed[new]
            start, end = entry["data_offsets"]
            fin.seek(base + start)
            if new == tiny.PATCH_EMBED:
                data = np.frombuffer(fin.read(end - start), dtype="<u2").reshape(entry["shape"])
                fout.write(np.ascontiguousarray(data.transpose(0, 4, 1, 2, 3)).tobytes())
                continue
            left = end - start
            while left:
                piece = fin.read(min(left, 1 << 26))
                fout.write(piece)
                left -= len(piece)
    (tmp / "stand-in.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    tmp.rename(folder)
    progress(f"wrote {folder}")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--variant",
        choices=VARIANTS + ("torch", "all"),
        default="all",
        help="'torch': the bf16 stand-in in the original layout, for transformers",
    )
    parser.add_argument("--dir", help=f"cache folder (default {default_dir()})")
    args = parser.parse_args()
    for variant in VARIANTS + ("torch",) if args.variant == "all" else (args.variant,):
        if variant == "torch":
            print(ensure_torch_layout(args.dir), flush=True)
        else:
            print(ensure_checkpoint(variant, args.dir), flush=True)


if __name__ == "__main__":
    main()
