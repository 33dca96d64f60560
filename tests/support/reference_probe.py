"""Whether the installed transformers' ``cohere_compass`` can serve as the live reference.

The recorded reference is transformers 5.24's. transformers ships ``cohere_compass`` before
5.21 too, but its image processor resolves pixel bounds differently there (measured with 5.17:
a call-time ``min_pixels`` or ``max_pixels`` alone is ignored, tokenizer_config.json's single
bounds likewise; LA/RGBA/palette images give other pixels), so such a transformers is skipped
like a missing one. What is looked for is that behaviour, not a version number.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional

PIL_PROCESSOR = "transformers.models.cohere_compass.image_processing_pil_cohere_compass"


@functools.lru_cache(maxsize=None)
def reference_problem() -> Optional[str]:
    """None if transformers' PIL image processor for cohere_compass exists and applies a call-time
    ``min_pixels`` on its own (as the recorded reference does); else why it cannot be the reference."""
    try:
        import transformers

        module = importlib.import_module(PIL_PROCESSOR)
    except ImportError as exc:
        return f"transformers has no cohere_compass image processor ({exc})"
    import numpy as np
    from PIL import Image

    processor = module.CohereCompassImageProcessorPil()
    picture = Image.fromarray(np.full((64, 64, 3), 128, np.uint8))
    plain = processor(images=[picture], return_tensors="np")["image_grid_thw"].tolist()
    grown = processor(images=[picture], min_pixels=4 * 128 * 128, return_tensors="np")["image_grid_thw"].tolist()
    if grown == plain:
        return (
            f"transformers {transformers.__version__}'s cohere_compass image processor ignores a call-time "
            f"min_pixels given alone (grid {plain} either way); the reference resolves bounds as 5.21+ does"
        )
    return None
