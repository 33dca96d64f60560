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
"""

from __future__ import annotations

import json
import pathlib
from typing import Dict

import numpy as np

from . import tiny

TOY_DIR = pathlib.Path(__file__).resolve().parent / "toy_shapes"
WEIGHTS_FILE = TOY_DIR / "model.safetensors"
PROVENANCE_FILE = TOY_DIR / "provenance.json"


# The tiny config's window (16) is shorter than an image prompt: in its six sliding layers the
# answer could not see the picture. The toy's window covers every prompt whose picture is within
# the pixel bounds (602112 pixels: 588 image tokens) plus its text.
SLIDING_WINDOW = 640
# Told per token which kind it sees, the tiny tower (width 32) read 33% of kinds right after
# 600 steps, width 64 50%, and 99% after 1500 (the vision phase's curve: provenance.json).
VISION_WIDTH = dict(hidden_size=64, num_heads=4, intermediate_size=128)


def toy_config(dtype: str = "float32") -> dict:
    """config.json of the toy: the tiny default config without its test-only unknown keys, with
    a sliding window (:data:`SLIDING_WINDOW`) longer than its prompts and a wider vision tower
    (:data:`VISION_WIDTH`)."""
    config = tiny.strip_test_keys(tiny.tiny_config("default", dtype))
    config["text_config"]["sliding_window"] = SLIDING_WINDOW
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
