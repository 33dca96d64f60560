"""A pytest plugin that plants one deliberate defect in the live vendored package: proof the marked tests bite.

    COMPASS_COMPAT_IMPLEMENTATION=vendored COMPASS_COMPAT_TEST_DEFECT=sliding_window_off_by_one \\
        python -m pytest tests -m checklist -p tests.support.defects --checklist-measure

Each defect, and the items whose tests it breaks (measured with every marked test; CHECKLIST.md,
"The checks catch real defects"): ``DEFECTS[name] = (plant, items)``. tests/test_checklist_defects.py runs one in CI.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable, Dict, Tuple

import numpy as np

ENV = "COMPASS_COMPAT_TEST_DEFECT"
PACKAGE = "mlx_vlm.models.cohere_compass"


def _module(name: str):
    return importlib.import_module(f"{PACKAGE}.{name}")


def sliding_window_off_by_one() -> None:
    language = _module("language")
    original = language.causal_mask
    language.causal_mask = lambda L, K, window: original(L, K, None if window is None else window + 1)


def contiguous_mrope() -> None:
    # transformers 5.18-5.20's layout: [T]*s0 + [H]*s1 + [W]*s2 instead of interleaved slots.
    language = _module("language")

    def contiguous(section, half_dim):
        axes = np.concatenate([np.full(n, axis, np.int32) for axis, n in enumerate(section)])
        assert len(axes) == half_dim
        return axes

    language.mrope_axis_table = contiguous


def processor_ignores_preprocessor_config() -> None:
    cls = _module("processing_cohere_compass").CohereCompassImageProcessor
    original = cls.__dict__["from_dict"]
    cls.from_dict = classmethod(lambda c, values, **kw: original.__func__(c, {}, **kw))


def processor_ignores_tokenizer_pixel_bounds() -> None:
    # The old processor's mistake: tokenizer_config.json's min/max_pixels not merged in (only while
    # the processor loads: the probe's expectation uses the same resolver).
    cls = _module("processing_cohere_compass").CohereCompassProcessor
    image_processing = _module("image_processing_cohere_compass")
    original, resolve = cls.__dict__["from_pretrained"], image_processing.resolve_pixel_bounds

    def without_tokenizer(image_config, image_config_file=None, tokenizer_config=None, *args, **kwargs):
        return resolve(image_config, image_config_file, None, *args, **kwargs)

    def from_pretrained(c, *args, **kwargs):
        image_processing.resolve_pixel_bounds = without_tokenizer
        try:
            return original.__func__(c, *args, **kwargs)
        finally:
            image_processing.resolve_pixel_bounds = resolve

    cls.from_pretrained = classmethod(from_pretrained)


def detokenizer_unguarded() -> None:
    cls = _module("processing_cohere_compass").CohereCompassProcessor
    cls.detokenizer = property(
        lambda self: self.__dict__["_detokenizer"],
        lambda self, value: self.__dict__.__setitem__("_detokenizer", value),
    )


def replay_drops_deepstack() -> None:
    cls = _module("cohere_compass").Model
    original = cls.get_input_embeddings

    def get_input_embeddings(self, *args, cached_image_features=None, **kwargs):
        if cached_image_features is not None:
            width = self.config.text_config.hidden_size
            kept = cached_image_features[:, :width]  # the deepstack columns dropped
            cached_image_features = {"image_features": kept, "deepstack_features": kept[None, :, :0][:0]}
        return original(self, *args, cached_image_features=cached_image_features, **kwargs)

    cls.get_input_embeddings = get_input_embeddings


def video_untimestamped() -> None:
    # A contiguous-time video prompt: one block of all the pads, no <t seconds> per patch.
    cls = _module("processing_cohere_compass").CohereCompassProcessor
    original = cls._video_blocks

    def contiguous(self, grids, settled, video_kwargs):
        blocks, total = original(self, grids, settled, video_kwargs)
        pads = [block.count(self.video_token) for block in blocks]
        return [self.vision_start_token + self.video_token * n + self.vision_end_token for n in pads], total

    cls._video_blocks = contiguous


DEFECTS: Dict[str, Tuple[Callable[[], None], Tuple[str, ...]]] = {
    # Every prompt longer than the window: text, image, both layouts' image case, video.
    "sliding_window_off_by_one": (sliding_window_off_by_one, ("2", "3", "9", "11")),
    "contiguous_mrope": (contiguous_mrope, ("3", "9", "11")),  # text (all axes equal) unaffected
    "processor_ignores_preprocessor_config": (processor_ignores_preprocessor_config, ("3",)),
    "processor_ignores_tokenizer_pixel_bounds": (processor_ignores_tokenizer_pixel_bounds, ("3",)),
    "replay_drops_deepstack": (replay_drops_deepstack, ("4",)),
    "detokenizer_unguarded": (detokenizer_unguarded, ("10",)),
    "video_untimestamped": (video_untimestamped, ("11",)),
}


def pytest_configure(config) -> None:
    """Plant ``$COMPASS_COMPAT_TEST_DEFECT`` in the vendored package, which must be the live one."""
    import compass_compat

    name = os.environ.get(ENV, "")
    if name not in DEFECTS:
        raise SystemExit(f"{ENV}={name!r}: name one of {', '.join(DEFECTS)}")
    compass_compat.apply_patch()
    if compass_compat.implementation_info().implementation != "vendored":
        raise SystemExit(f"{ENV}: the defects are the vendored package's; set COMPASS_COMPAT_IMPLEMENTATION=vendored")
    DEFECTS[name][0]()
