"""A recorded reference case read back, and driven the way mlx-vlm drives a model.

:func:`read_case_arrays` / :func:`read_video_case` (the one reader of a case file,
``recorded.py``), :func:`case_inputs` (what ``Model.__call__`` takes), :func:`stream_ids`
(mlx-vlm's own ``stream_generate``, with a spy on what the processor handed the model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

LOGIT_TOL = 1e-4  # prefill logits vs the transformers reference (float32 both sides)
PIXEL_TOL = 1e-5  # pixel values vs the reference processor
N_GREEDY = 32


def unpack_pixel_values(pixel_values_codes: np.ndarray, pixel_values_levels: np.ndarray) -> np.ndarray:
    """[N, 3*2*P*P] float32 pixel values from their stored form (``scripts/reference/model_outputs.py``'s ``pack_pixel_values``).

    Stored: the first temporal frame as per-channel uint8 indices into a table of float32 values;
    the second frame of a still image is the same.
    """
    n = pixel_values_codes.shape[0]
    codes = pixel_values_codes.reshape(n, 3, 1, -1).astype(np.intp)
    frame0 = np.take_along_axis(pixel_values_levels[None, :, None, :], codes, axis=-1)
    return np.repeat(frame0, 2, axis=2).reshape(n, -1)


def unpack_levels(codes: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Pixel values [N, 3*T*P*P] float32 from per-channel codes into a table of values
    (``tests/support/video_fixtures.py`` ``pack_levels``: every temporal slot stored)."""
    n = codes.shape[0]
    values = np.take_along_axis(levels[None], codes.reshape(n, 3, -1).astype(np.intp), axis=-1)
    return values.reshape(codes.shape)


def read_video_case(path: Path) -> Dict[str, np.ndarray]:
    """The arrays of one video reference case file, pixel values unpacked."""
    from safetensors.numpy import load_file

    arrays = load_file(str(path))
    for key in ("pixel_values_videos", "pixel_values"):
        if f"{key}_codes" in arrays:
            arrays[key] = unpack_levels(arrays.pop(f"{key}_codes"), arrays.pop(f"{key}_levels"))
    return arrays


def read_case_arrays(path: Path) -> Dict[str, np.ndarray]:
    """The arrays of one reference case file, pixel values unpacked."""
    from safetensors.numpy import load_file

    arrays = load_file(str(path))
    if "pixel_values_codes" in arrays:
        arrays["pixel_values"] = unpack_pixel_values(
            arrays.pop("pixel_values_codes"), arrays.pop("pixel_values_levels")
        )
    return arrays


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
