"""The toy checkpoint: the tiny cohere_compass trained on synthetic shape pictures.

A TOY, not North-Micro-Vision: it answers the four questions of :mod:`compass_data.shapes`
about pictures like the ones it was trained on (one to three circles, squares, triangles and
stars in four colours on a light background) and a few text-only prompts, and nothing else.
What it is for: an answer a person can check against the picture, and an end-to-end test whose
expected answers come from transformers' reference model on the same weights.

The trained weights (original layout, float32) and their provenance (the training script, data
recipe, seeds, training curve, held-out accuracy) are committed in ``compass_data/toy_shapes``;
``scripts/toy/train.py`` made them. :func:`build_toy_checkpoint` writes the same file set as the
tiny random checkpoint (:mod:`compass_data.tiny`), with these weights.

The default checkpoint of ``python -m compass_compat`` is this toy, built once into a cache
folder (:func:`ensure_default_checkpoint`) and checked on every use against a marker file of
fingerprints (:func:`default_checkpoint_problem`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from importlib import metadata
from typing import Dict, Optional

import numpy as np

from . import tiny

TOY_DIR = pathlib.Path(__file__).resolve().parent / "toy_shapes"
WEIGHTS_FILE = TOY_DIR / "model.safetensors"
PROVENANCE_FILE = TOY_DIR / "provenance.json"

HOME_ENV = "COMPASS_COMPAT_HOME"
DEFAULT_CHECKPOINT = "toy-shapes-v5"  # bump the suffix when the builder's output changes
MARKER = "compass-compat-default.json"
TOY_NOTE = (
    "compass-compat's default checkpoint: a TOY, the tiny cohere_compass trained on synthetic "
    "pictures of shapes, not North-Micro-Vision. It answers 'Describe this picture.', 'How many "
    "shapes are there?', 'What colour is the <shape>?' and 'Where is the <colour> <shape>?' "
    "about pictures like the demo (its accuracy: README) and nothing else. Pass --model PATH "
    "for a real checkpoint."
)


# The tiny config's window (16) is shorter than an image prompt: in its six sliding layers the
# answer could not see the picture. The toy's window covers every prompt whose picture is within
# the pixel bounds (602112 pixels: 588 image tokens) plus its text.
SLIDING_WINDOW = 640
# Told per token which kind it sees, the tiny tower (width 32) read 33% of kinds right after
# 600 steps, width 64 50%, and 99% after 1500 (the vision phase's curve: provenance.json).
VISION_WIDTH = dict(hidden_size=64, num_heads=4, intermediate_size=128)
# One head of 64 (one KV head), not the tiny config's four of 16: mx.quantize groups a key by
# 32, 64 or 128, so uniform KV-cache quantization needs head_dim >= 32, and mlx-vlm's default
# kv_group_size (64) needs head_dim 64 or 128 (the full model's is 128). Stages 11-13 had two
# heads of 32, stage 14 merged them (provenance.json).
TEXT_HEADS = dict(num_attention_heads=1, num_key_value_heads=1)
MROPE_SECTION = [16, 8, 8]  # head_dim // 2 rotary pairs, split t/h/w as the tiny config's [4, 2, 2]


def toy_config(dtype: str = "float32") -> dict:
    """config.json of the toy: the tiny default config without its test-only unknown keys, with
    a sliding window (:data:`SLIDING_WINDOW`) longer than its prompts, one text head of 64
    (:data:`TEXT_HEADS`) and a wider vision tower (:data:`VISION_WIDTH`)."""
    config = tiny.strip_test_keys(tiny.tiny_config("default", dtype))
    config["text_config"]["sliding_window"] = SLIDING_WINDOW
    config["text_config"].update(TEXT_HEADS)
    config["text_config"]["rope_parameters"]["sliding_attention"]["mrope_section"] = list(MROPE_SECTION)
    config["vision_config"].update(VISION_WIDTH)
    return config


def toy_weights() -> Dict[str, np.ndarray]:
    """The committed trained weights, original layout, float32.

    Raises ``FileNotFoundError`` naming the script that makes them when the file is missing.
    """
    if not WEIGHTS_FILE.is_file():
        raise FileNotFoundError(
            f"{WEIGHTS_FILE} is missing: it is part of the package; reinstall compass-compat, or "
            "retrain with `.venvs/mlxvlm-0.7.10/bin/python scripts/toy/train.py`"
        )
    from safetensors.numpy import load_file

    return load_file(str(WEIGHTS_FILE))


def provenance() -> dict:
    """The committed provenance record (how the weights were trained and how well they do)."""
    return json.loads(PROVENANCE_FILE.read_text(encoding="utf-8"))


def build_toy_checkpoint(path, *, layout: str = "original", dtype: str = "float32") -> pathlib.Path:
    """Write the toy checkpoint folder at ``path`` (created if needed) and return it."""
    return tiny.write_checkpoint(path, toy_config(dtype), toy_weights(), layout=layout, dtype=dtype)


# ------------------------------------------------------------- the default checkpoint's cache


def cache_dir() -> pathlib.Path:
    """``$COMPASS_COMPAT_HOME``, else ``$XDG_CACHE_HOME/compass-compat``, else ``~/.cache/compass-compat``."""
    home = os.environ.get(HOME_ENV, "").strip()
    if home:
        return pathlib.Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache") / "compass-compat"


def default_checkpoint_path() -> pathlib.Path:
    """Where the default checkpoint is (or will be) built: :data:`DEFAULT_CHECKPOINT` in :func:`cache_dir`."""
    return cache_dir() / DEFAULT_CHECKPOINT


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _trained_weights_sha256() -> str:
    return _sha256(WEIGHTS_FILE) if WEIGHTS_FILE.is_file() else "missing"


def default_checkpoint_problem(path: pathlib.Path) -> Optional[str]:
    """None if ``path`` holds a complete default checkpoint, else what is wrong with it."""
    marker = path / MARKER
    if not marker.is_file():
        return f"{MARKER} is missing" if path.exists() else "not built yet"
    try:
        meta = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"{MARKER} is unreadable ({err})"
    for name, digest in meta.get("sha256", {}).items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if _sha256(path / name) != digest:
            return f"{name} changed since it was built"
    if not meta.get("sha256"):
        return f"{MARKER} lists no files"
    # A package upgrade can ship retrained toy weights under the same folder name.
    if meta.get("trained_weights_sha256") != _trained_weights_sha256():
        return "built from other toy weights than this compass-compat ships"
    return None


def _log(message: str) -> None:
    print(f"[compass-compat] {message}", file=sys.stderr, flush=True)


def _installed_version() -> str:
    # From the distribution's metadata: importing compass_compat would patch mlx-vlm.
    try:
        return metadata.version("compass-compat")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def ensure_default_checkpoint(version: Optional[str] = None) -> pathlib.Path:
    """Build the default checkpoint once (atomically; concurrent builders are safe) and return it.

    ``version`` is the compass-compat version recorded in the folder (default: the installed
    distribution's). Progress goes to stderr, one ``[compass-compat]`` line per step.
    """
    target = default_checkpoint_path()
    problem = default_checkpoint_problem(target)
    if problem is None:
        return target
    version = _installed_version() if version is None else version
    _log(f"building the default checkpoint in {target} ({problem})")
    _log("  the toy: tiny cohere_compass trained on synthetic shapes, original (CohereLabs) layout, float32")
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{DEFAULT_CHECKPOINT}-", dir=target.parent))
    try:
        _log("  [1/3] config.json, tokenizer, chat template, preprocessor config, weights")
        build_toy_checkpoint(staging, layout="original", dtype="float32")
        (staging / "README.md").write_text(
            "# compass-compat default checkpoint\n\n" + TOY_NOTE + "\n\n"
            f"Built by compass-compat {version} (`compass_data.toy.build_toy_checkpoint`); "
            "how the weights were trained: compass_data/toy_shapes/provenance.json.\n",
            encoding="utf-8",
        )
        _log("  [2/3] fingerprinting the files")
        files = sorted(p.name for p in staging.iterdir() if p.is_file())
        meta = {
            "built_by": f"compass-compat {version}",
            "weights": "trained toy (compass_data/toy_shapes, scripts/toy/train.py)",
            "sha256": {name: _sha256(staging / name) for name in files},
            "trained_weights_sha256": _trained_weights_sha256(),
        }
        (staging / MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        _log("  [3/3] moving it into place")
        if target.exists() and default_checkpoint_problem(target) is not None:
            shutil.rmtree(target)  # damaged: replaced below
        try:
            os.replace(staging, target)
        except OSError:
            if default_checkpoint_problem(target) is not None:
                raise
            return target  # another process finished the same build first
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    size = sum(p.stat().st_size for p in target.iterdir()) / 1e6
    _log(f"  done: {size:.1f} MB in {time.perf_counter() - start:.2f} s")
    return target
