"""The reference fixtures, the tiny checkpoints, and driving a model the way mlx-vlm drives it.

The tests use the same pieces, through scripts/_lib: :func:`read_case_arrays` (the one reader of
a case file, ``recorded.py``), :func:`case_inputs` (``parity.py``) and :func:`stream_ids`
(``mlx_vlm_run.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .report import CouldNotRun
from .target import Target, within

LOGIT_TOL = 1e-4  # prefill logits vs the transformers reference (float32 both sides)
PIXEL_TOL = 1e-5  # pixel values vs the reference processor
N_GREEDY = 32


def default_fixtures_dir() -> Path:
    """``<repo>/tests/fixtures`` next to this package (exists only in a source checkout)."""
    return Path(__file__).resolve().parents[2] / "tests" / "fixtures"


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
    (``scripts/_lib/video_fixtures.py`` ``pack_levels``: every temporal slot stored)."""
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


class Reference:
    """The recorded transformers outputs (``tests/fixtures/reference``) and their images."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.reference_dir = self.directory / "reference"
        self.images_dir = self.directory / "images"
        index = self.reference_dir / "index.json"
        if not index.is_file():
            raise CouldNotRun(
                f"reference fixtures not found: {index} does not exist. They live in the "
                "compass-compat repository checkout (tests/fixtures) and are not shipped in the "
                "wheel; run the checklist from a checkout or pass --fixtures DIR"
            )
        self.index = json.loads(index.read_text(encoding="utf-8"))
        self.cases: Dict[str, Dict[str, Any]] = dict(self.index["cases"])
        missing = [
            str(self.images_dir / name)
            for meta in self.cases.values()
            for name in meta.get("images", [])
            if not (self.images_dir / name).is_file()
        ]
        missing += [
            str(self.reference_dir / meta["file"])
            for meta in self.cases.values()
            if not (self.reference_dir / meta["file"]).is_file()
        ]
        if missing:
            raise CouldNotRun(f"reference fixtures incomplete, missing: {', '.join(missing)}")
        self._arrays: Dict[str, Dict[str, np.ndarray]] = {}

    def names(self, kind: str) -> List[str]:
        """Case names of one kind ("text" or "image"), in index order."""
        return [name for name, meta in self.cases.items() if meta["kind"] == kind]

    def image_paths(self, name: str) -> List[str]:
        """The image files of a case, in prompt order."""
        return [str(self.images_dir / image) for image in self.cases[name].get("images", [])]

    def __call__(self, name: str) -> Dict[str, np.ndarray]:
        """The arrays of one case (pixel values unpacked to [N, 3*2*16*16] float32)."""
        if name not in self._arrays:
            self._arrays[name] = read_case_arrays(self.reference_dir / self.cases[name]["file"])
        return self._arrays[name]


def check_fixture_weights(reference: Reference) -> None:
    """Raise :class:`CouldNotRun` unless the fixtures were recorded from the weights ``tiny`` builds."""
    from compass_data.tiny import tiny_weights, weights_sha256

    recorded = reference.index.get("checkpoint", {})
    want = recorded.get("weights_sha256")
    got = weights_sha256(tiny_weights(int(recorded.get("seed", 0))))
    if want != got:
        raise CouldNotRun(
            f"the reference fixtures were recorded from other tiny weights (sha256 {want}, this "
            f"compass_compat builds {got}); re-record them with scripts/reference/model_outputs.py"
        )


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


class Context:
    """What the items share: fixtures, the implementation, built checkpoints, loaded models."""

    def __init__(self, target: Target, reference: Reference, workdir: Path):
        self.target = target
        self.reference = reference
        self.workdir = workdir
        self._checkpoints: Dict[str, Path] = {}
        self._loaded: Dict[str, Any] = {}

    # checkpoints -------------------------------------------------------
    def checkpoint(self, name: str) -> Path:
        """Tiny checkpoint folders: "original", "mlx", "small_max_pixels" (original layout)."""
        if name not in self._checkpoints:
            from compass_data.tiny import build_tiny_checkpoint

            layout = "mlx" if name == "mlx" else "original"
            variant = "small_max_pixels" if name == "small_max_pixels" else "default"
            self._checkpoints[name] = build_tiny_checkpoint(self.workdir / name, layout=layout, variant=variant)
        return self._checkpoints[name]

    def load(self, path: Path) -> Tuple[Any, Any]:
        """``mlx_vlm.load`` (model, processor), once per folder; a load error is re-raised each time."""
        key = str(path)
        if key not in self._loaded:
            try:
                from mlx_vlm import load

                model, processor = load(str(path))
            except Exception as exc:  # reported as the evidence of every item that needs it
                self._loaded[key] = exc
            else:
                self.check_model_source(model)  # CouldNotRun: no item can be attributed
                self._loaded[key] = (model, processor)
        value = self._loaded[key]
        if isinstance(value, BaseException):
            raise value
        return value

    def check_model_source(self, model: Any) -> None:
        """Raise :class:`CouldNotRun` unless ``model`` comes from the implementation under test."""
        module = sys.modules.get(type(model).__module__)
        file = getattr(module, "__file__", None)
        if self.target.package_dir is None or not within(file, self.target.package_dir):
            raise CouldNotRun(
                f"mlx_vlm.load built {type(model).__module__}.{type(model).__name__} from {file}, "
                f"not from the {self.target.kind} package {self.target.package_dir}"
            )

    # driving a model -------------------------------------------------
    def model_inputs(self, name: str) -> Tuple[Any, Any, Dict[str, Any]]:
        """(input_ids, pixel_values or None, extra kwargs) of a reference case, as mlx arrays."""
        return case_inputs(self.reference(name))

    @staticmethod
    def prefill_logits(model: Any, ids: Any, pixel_values: Any, extra: Dict[str, Any]) -> np.ndarray:
        """Logits [L, V] of one forward pass through ``Model.__call__`` with a fresh cache."""
        cache = model.language_model.make_cache() if hasattr(model.language_model, "make_cache") else None
        out = model(ids, pixel_values, cache=cache, **extra)
        logits = getattr(out, "logits", out)
        return np.array(logits[0], dtype=np.float32)

    @staticmethod
    def greedy_ids(model: Any, ids: Any, pixel_values: Any, extra: Dict[str, Any], n: int = N_GREEDY) -> List[int]:
        """n greedy ids from mlx-vlm's own ``generate_step`` on the reference inputs."""
        from mlx_vlm.generate import generate_step

        out: List[int] = []
        for token, _ in generate_step(ids, model, pixel_values, None, max_tokens=n, temperature=0.0, **extra):
            out.append(int(token.item() if hasattr(token, "item") else token))
            if len(out) >= n:
                break
        return out

    @staticmethod
    def prompt_path(model: Any, processor: Any, prompt: str, images: List[str], n: int) -> Dict[str, Any]:
        """Run ``mlx_vlm.stream_generate`` on a prompt; return what the model was fed and the ids."""
        fed: List[Dict[str, Any]] = []
        tokens = stream_ids(model, processor, prompt, images, n, fed=fed)
        if not fed:
            raise RuntimeError("stream_generate never called get_input_embeddings")
        return {"fed": fed[0], "tokens": tokens}

    def eos_id(self) -> Optional[int]:
        """The tiny checkpoint's end-of-turn id (mlx-vlm stops streaming there)."""
        config = json.loads((self.checkpoint("original") / "config.json").read_text(encoding="utf-8"))
        return config.get("eos_token_id")

    def expected_stream(self, name: str) -> List[int]:
        """Reference greedy ids as mlx-vlm streams them: up to and including an end-of-turn id."""
        want = token_list(self.reference(name)["greedy_ids"])
        eos = self.eos_id()
        return want[: want.index(eos) + 1] if eos in want else want
