"""A recorded reference case (read by ``recorded.py``) driven the way mlx-vlm drives a model:
:func:`case_inputs` (what ``Model.__call__`` takes), :func:`stream_ids` (mlx-vlm's own
``stream_generate``, with a spy on what the processor handed the model).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

LOGIT_TOL = 1e-4  # prefill logits vs the transformers reference (float32 both sides)
PIXEL_TOL = 1e-5  # pixel values vs the reference processor
N_GREEDY = 32


def max_abs(a: Any, b: Any) -> float:
    """max |a - b|, computed in float64."""
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def token_list(tokens: Any) -> List[int]:
    """Token ids of any array-like, flattened, as Python ints."""
    return [int(t) for t in np.asarray(tokens).reshape(-1).tolist()]


def matching_prefix(got: Sequence[int], want: Sequence[int]) -> int:
    """How many leading ids agree."""
    n = 0
    for a, b in zip(got, want):
        if a != b:
            break
        n += 1
    return n


def case_inputs(case: Dict[str, Any]) -> Tuple[Any, Any, Dict[str, Any]]:
    """(input_ids, pixel_values or None, extra kwargs) of a case's arrays, as mlx arrays:
    what ``Model.__call__`` takes (a video case's frames and grid are in the extra kwargs)."""
    import mlx.core as mx

    ids = mx.array(case["input_ids"])
    extra: Dict[str, Any] = {}
    if "pixel_values_videos" in case:
        extra["pixel_values_videos"] = mx.array(case["pixel_values_videos"])
        extra["video_grid_thw"] = mx.array(case["video_grid_thw"])
    if "pixel_values" in case:
        extra["image_grid_thw"] = mx.array(case["image_grid_thw"])
    if extra:
        extra["mm_token_type_ids"] = mx.array(case["mm_token_type_ids"])
    pixels = mx.array(case["pixel_values"]) if "pixel_values" in case else None
    return ids, pixels, extra


def stream_ids(
    model: Any,
    processor: Any,
    prompt: str,
    images: Optional[Sequence[str]] = None,
    max_tokens: int = N_GREEDY,
    fed: Optional[List[Dict[str, Any]]] = None,
    **kwargs: Any,
) -> List[int]:
    """Greedy ids from mlx-vlm's own ``stream_generate`` (temperature 0 unless ``kwargs`` say).

    With ``fed``, a spy on ``model.get_input_embeddings`` appends what each call received
    (input ids, pixel values, image grid, as numpy): the processor's output as mlx-vlm hands it
    to the model.
    """
    from mlx_vlm import stream_generate

    if fed is not None:
        original = model.get_input_embeddings

        def spy(input_ids: Any = None, *args: Any, **kw: Any) -> Any:
            pixels = args[0] if args else kw.get("pixel_values")
            grid = kw.get("image_grid_thw")
            fed.append(
                {
                    "input_ids": np.array(input_ids),
                    "pixel_values": None if pixels is None else np.array(pixels),
                    "image_grid_thw": None if grid is None else np.array(grid),
                }
            )
            return original(input_ids, *args, **kw)

        model.get_input_embeddings = spy
    kwargs.setdefault("temperature", 0.0)
    seen: Dict[int, int] = {}
    try:
        for result in stream_generate(
            model, processor, prompt, image=list(images) if images else None, max_tokens=max_tokens, **kwargs
        ):
            # mlx-vlm 0.3.x yields the last token twice (again after finalizing).
            seen.setdefault(int(result.generation_tokens), int(result.token))
    finally:
        if fed is not None:
            del model.get_input_embeddings
    return [seen[k] for k in sorted(seen)]
