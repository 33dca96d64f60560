"""The recorded transformers reference, read back: the tiny checkpoint's cases
(tests/fixtures/reference, written by scripts/reference/model_outputs.py) and its video cases
(tests/fixtures/video_model, written by scripts/reference/video_model.py). Arrays are read-only.
"""

from __future__ import annotations

import functools
import json
import pathlib

from tests.support.cases import read_case_arrays, read_video_case

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures"
REFERENCE_DIR = FIXTURES / "reference"
VIDEO_MODEL_DIR = FIXTURES / "video_model"
VIDEO_INDEX = json.loads((VIDEO_MODEL_DIR / "index.json").read_text(encoding="utf-8"))


def _read_only(arrays: dict) -> dict:
    for value in arrays.values():
        value.flags.writeable = False
    return arrays


class ReferenceFixtures:
    """``reference("img_448")`` -> dict of read-only numpy arrays plus ``"meta"`` (its index entry).

    Arrays: input_ids, prefill_logits, greedy_ids, greedy_logits; image cases also pixel_values,
    image_grid_thw, mm_token_type_ids, position_ids, rope_deltas, image_features,
    deepstack_features. ``reference.index`` is index.json; ``reference.cases`` the case names.
    """

    def __init__(self, directory: pathlib.Path = REFERENCE_DIR):
        self.directory = directory
        self.index = json.loads((directory / "index.json").read_text(encoding="utf-8"))
        self.cases = list(self.index["cases"])

    @functools.lru_cache(maxsize=None)
    def _arrays(self, name: str) -> dict:
        return _read_only(read_case_arrays(self.directory / self.index["cases"][name]["file"]))

    def __call__(self, name: str) -> dict:
        return {**self._arrays(name), "meta": self.index["cases"][name]}


@functools.lru_cache(maxsize=None)
def _video_arrays(checkpoint: str, name: str) -> dict:
    entry = VIDEO_INDEX["checkpoints"][checkpoint][name]
    return _read_only(read_video_case(VIDEO_MODEL_DIR / checkpoint / entry["file"]))


def video_case(checkpoint: str, name: str) -> dict:
    """Video case ``name`` of ``checkpoint`` ("tiny" or "toy"): read-only arrays plus ``"meta"``."""
    return {**_video_arrays(checkpoint, name), "meta": VIDEO_INDEX["checkpoints"][checkpoint][name]}
