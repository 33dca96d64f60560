"""The tiny checkpoint's reference cases, the synthetic test images and the recording of what
transformers computes on them (torch + transformers >= 5.21; no compass_compat import, which would
patch mlx-vlm): scripts/reference/model_outputs.py writes tests/fixtures/reference from
:func:`record`, tests/test_reference_fixtures.py re-records two cases live and checks the images.
"""

from __future__ import annotations

import hashlib
import pathlib
import tempfile
from typing import Dict, List, Optional, Sequence

import numpy as np

from compass_data import tiny
from tests.support import reference as _reference
from tests.support.pixels import pack_pixel_values

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
REFERENCE_DIR = FIXTURES / "reference"
IMAGES_DIR = FIXTURES / "images"
MIN_TRANSFORMERS = (5, 21)
N_GREEDY = 32
FORMAT = 1


# name -> (width, height, seed)
IMAGES = {
    "synth_448x448.png": (448, 448, 1),
    "synth_640x480.png": (640, 480, 2),
    "synth_501x379.png": (501, 379, 3),
    "synth_448x448_b.png": (448, 448, 4),
    "synth_320x256.png": (320, 256, 5),
    "synth_256x320.png": (256, 320, 6),
}


def _user(*parts) -> List[dict]:
    content = [{"type": "image", "image": p} if p.endswith(".png") else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


CASES: Dict[str, List[dict]] = {
    "text_short": [{"role": "user", "content": "Hello there!"}],
    "text_medium": [
        {
            "role": "user",
            "content": "Write a short story about a lighthouse keeper who finds an old map inside a "
            "bottle and follows the path to the hills.",
        }
    ],
    "text_long": [
        {
            "role": "user",
            "content": "Summarise the following paragraph: the city was quiet in the early morning, "
            "the streets were wet with rain, and the first buses carried workers to the station "
            "while the shops were still closed. The children played in the park until the evening, "
            "when their parents called them home for dinner. The keeper walked along the shore every "
            "morning, counting the boats that came home with the tide.",
        }
    ],
    "img_448": _user("synth_448x448.png", "Describe this image."),
    "img_640x480": _user("synth_640x480.png", "What colour is the square?"),
    "img_501x379": _user("synth_501x379.png", "Count the circles in the image."),
    "img_two": _user("synth_448x448_b.png", "synth_320x256.png", "Compare the two images."),
    "img_middle": _user("Look at this picture:", "synth_256x320.png", "What is in the picture?"),
}


def image_names(messages: List[dict]) -> List[str]:
    parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"]]
    return [p["image"] for p in parts if p["type"] == "image"]


# --------------------------------------------------------------------------- images
def make_image(width: int, height: int, seed: int) -> np.ndarray:
    """A deterministic RGB test image [H, W, 3] uint8: gradients, seeded noise, a few shapes.

    Only exact arithmetic (no transcendental functions), so every machine draws the same pixels.
    """
    rng = np.random.default_rng([7, seed])
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    fx, fy = x / (width - 1), y / (height - 1)
    img = np.stack([200 * fx + 30, 180 * fy + 40, 120 * (1 - fx) * fy + 60 * fx + 50], axis=-1)
    img += np.floor(rng.random((height, width, 3)) * 13) - 6  # noise in [-6, 6]
    c = (rng.random(4) * 0.6 + 0.2) * [width, height, width, height]  # circle and rectangle centres
    r = min(width, height) * (0.1 + 0.1 * rng.random())
    img[(x - c[0]) ** 2 + (y - c[1]) ** 2 <= r * r] = [40, 70, 220]  # circle
    img[(abs(x - c[2]) <= width * 0.1) & (abs(y - c[3]) <= height * 0.075)] = [220, 40, 40]  # rectangle
    img[(y >= height * 0.7) & (y - height * 0.7 <= x - width * 0.1) & (x <= width * 0.45)] = [30, 190, 60]  # triangle
    img[np.abs(y - x * height / width) <= 1.5] = [250, 230, 30]  # diagonal line
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def write_images(directory: pathlib.Path = IMAGES_DIR) -> Dict[str, pathlib.Path]:
    """Write the PNGs; a file whose pixels are already right is left untouched."""
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, (w, h, seed) in IMAGES.items():
        pixels, path = make_image(w, h, seed), directory / name
        if not (path.exists() and np.array_equal(np.asarray(Image.open(path).convert("RGB")), pixels)):
            Image.fromarray(pixels, mode="RGB").save(path, format="PNG", optimize=False, compress_level=9)
        paths[name] = path
    return paths


# --------------------------------------------------------------------------- reference model
def require_reference() -> None:
    """Exit with a clear message unless torch and transformers >= 5.21 are importable."""
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as e:
        raise SystemExit(f"scripts/reference/model_outputs.py needs torch and transformers >= 5.21: {e}")
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    if version < MIN_TRANSFORMERS or not hasattr(transformers, "CohereCompassForConditionalGeneration"):
        raise SystemExit(
            f"scripts/reference/model_outputs.py needs transformers >= 5.21 (interleaved MRoPE cohere_compass); "
            f"this environment has {transformers.__version__}. Use .venvs/mlxvlm-0.7.10/bin/python."
        )


class Reference:
    """The tiny checkpoint loaded into transformers, plus its tokenizer and PIL image processor."""

    def __init__(self, checkpoint: pathlib.Path):
        from transformers.models.cohere_compass import CohereCompassProcessor

        self.model = model = _reference.load_model(checkpoint, "the tiny checkpoint")
        self.tokenizer, self.image_processor = _reference.tokenizer_and_image_processor(
            checkpoint, with_tokenizer_bounds=False
        )
        self.config = model.config

        class ProcessorWithoutVideo(CohereCompassProcessor):
            # AutoProcessor and the video processor need torchvision: build the processor from
            # its parts, with no video processor.
            def check_argument_for_proper_class(self, name, arg):
                return None if arg is None else super().check_argument_for_proper_class(name, arg)

        self.processor = ProcessorWithoutVideo(
            image_processor=self.image_processor, tokenizer=self.tokenizer, video_processor=None
        )

    def inputs(self, messages: List[dict], image_paths: Dict[str, pathlib.Path]) -> dict:
        """Model inputs as CohereCompassProcessor makes them from the checkpoint's files (its
        pixel bounds are tokenizer_config.json's, merged in by the processor), cross-checked
        against the tokenizer and chat template used directly."""
        import torch
        from PIL import Image

        prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        names = image_names(messages)
        out = {"prompt": prompt}
        text = prompt
        if names:
            images = [Image.open(image_paths[n]).convert("RGB") for n in names]
            # The rendered template already starts with BOS.
            processed = self.processor(text=[prompt], images=images, add_special_tokens=False, return_tensors="pt")
            grid = processed["image_grid_thw"]
            merge = self.image_processor.merge_size
            counts = [int(g.prod()) // merge**2 for g in grid]
            pieces = text.split("<|IMAGE_PAD|>")
            assert len(pieces) == len(counts) + 1, "one <|IMAGE_PAD|> per image part"
            text = pieces[0] + "".join("<|IMAGE_PAD|>" * n + rest for n, rest in zip(counts, pieces[1:]))
            out.update(pixel_values=processed["pixel_values"], image_grid_thw=grid, num_image_tokens=counts)
        ids = torch.tensor([self.tokenizer(text, add_special_tokens=False)["input_ids"]])
        out["input_ids"] = ids
        if names:
            out["mm_token_type_ids"] = (ids == self.config.image_token_id).long()
            assert int(out["mm_token_type_ids"].sum()) == sum(out["num_image_tokens"])
            for key in ("input_ids", "mm_token_type_ids"):
                if not torch.equal(torch.as_tensor(processed[key]).to(out[key].dtype), out[key]):
                    raise SystemExit(f"{key} differs from what CohereCompassProcessor produces")
        return out

    def forward(self, input_ids, inputs: dict, **kwargs):
        self.model.model.rope_deltas = None  # no state carried over from an earlier call
        extra = {}
        if "pixel_values" in inputs:
            mm = inputs["mm_token_type_ids"]
            pad = input_ids.shape[1] - mm.shape[1]
            extra = dict(
                pixel_values=inputs["pixel_values"],
                image_grid_thw=inputs["image_grid_thw"],
                mm_token_type_ids=_pad_zeros(mm, pad),
            )
        return self.model(input_ids=input_ids, **extra, **kwargs)

    def record(self, messages: List[dict], image_paths: Dict[str, pathlib.Path]) -> tuple:
        import torch

        inputs = self.inputs(messages, image_paths)
        ids = inputs["input_ids"]
        arrays: Dict[str, np.ndarray] = {"input_ids": ids.numpy().astype(np.int64)}
        with torch.no_grad():
            if "pixel_values" in inputs:
                pv, grid = inputs["pixel_values"], inputs["image_grid_thw"]
                feats = self.model.model.get_image_features(pv, grid)
                position_ids, rope_deltas = self.model.model.get_rope_index(
                    ids, mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=grid
                )
                arrays.update(
                    **pack_pixel_values(pv.numpy()),
                    image_grid_thw=grid.numpy().astype(np.int64),
                    mm_token_type_ids=inputs["mm_token_type_ids"].numpy().astype(np.int64),
                    position_ids=position_ids.numpy().astype(np.int64),
                    rope_deltas=rope_deltas.numpy().astype(np.int64).reshape(1, 1),
                    image_features=torch.cat(feats.pooler_output).numpy(),
                    deepstack_features=torch.stack([torch.cat(f) for f in feats.deepstack_features]).numpy(),
                )
            arrays["prefill_logits"] = self.forward(ids, inputs, use_cache=False).logits[0].numpy()

            greedy, arrays["greedy_logits"] = _reference.greedy_steps(
                lambda seq, **kw: self.forward(seq, inputs, **kw), ids, N_GREEDY
            )
            arrays["greedy_ids"] = np.asarray(greedy, dtype=np.int64)
            self._check_cached_decode(ids, inputs, arrays)

        top2 = np.sort(arrays["greedy_logits"], axis=-1)[:, -2:]
        meta = {
            "prompt": inputs["prompt"],
            "seq_len": int(ids.shape[1]),
            "num_image_tokens": inputs.get("num_image_tokens", []),
            "greedy_ids": greedy,
            "greedy_text": self.tokenizer.decode(greedy),
            "greedy_min_margin": round(float((top2[:, 1] - top2[:, 0]).min()), 4),
        }
        return arrays, meta

    def _check_cached_decode(self, ids, inputs: dict, arrays: dict) -> None:
        """The reference's own cached decode (sliding-window cache) must pick the same tokens."""
        got = _reference.cached_greedy(self.model, lambda seq, **kw: self.forward(seq, inputs, **kw), ids, N_GREEDY)
        if got != arrays["greedy_ids"].tolist():
            raise SystemExit(f"cached and uncached greedy decoding of the reference disagree: {got}")


def _pad_zeros(mm, pad: int):
    import torch

    return mm if pad == 0 else torch.cat([mm, torch.zeros((1, pad), dtype=mm.dtype)], dim=1)


# --------------------------------------------------------------------------- recording
def sha256_file(path: pathlib.Path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def checkpoint_fingerprints() -> dict:
    """sha256 of the weight values and of each model.safetensors the builder writes (no torch)."""
    files = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in tiny.LAYOUTS:
            for dtype in tiny.DTYPES:
                d = tiny.build_tiny_checkpoint(pathlib.Path(tmp) / f"{layout}-{dtype}", layout=layout, dtype=dtype)
                files[f"{layout}/{dtype}"] = sha256_file(d / "model.safetensors")
    return {"weights_sha256": tiny.weights_sha256(tiny.tiny_weights(0)), "safetensors_sha256": files}


def record(case_names: Optional[Sequence[str]] = None, write_images_too: bool = False) -> tuple:
    """Run the reference on the named cases (default: all). Returns ({case: arrays}, index).

    Images are read from tests/fixtures/images/ (written there first if ``write_images_too``).
    """
    require_reference()
    import tokenizers
    import torch
    import transformers

    names = list(CASES) if case_names is None else list(case_names)
    image_paths = write_images() if write_images_too else {n: IMAGES_DIR / n for n in IMAGES}
    results, cases = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = tiny.build_tiny_checkpoint(pathlib.Path(tmp) / "tiny", layout="original", dtype="float32")
        ref = Reference(checkpoint)
        for name in names:
            arrays, meta = ref.record(CASES[name], image_paths)
            results[name] = arrays
            images = image_names(CASES[name])
            cases[name] = {
                "file": f"{name}.safetensors",
                "kind": "image" if images else "text",
                "messages": CASES[name],
                "images": images,
                **meta,
            }
    index = {
        "format": FORMAT,
        "generated_by": "scripts/reference/model_outputs.py",
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
        },
        "model": {
            "class": "CohereCompassForConditionalGeneration",
            "dtype": "float32",
            "attn_implementation": "eager",
            "device": "cpu",
        },
        "checkpoint": {
            "layout": "original",
            "dtype": "float32",
            "seed": 0,
            "variant": "default",
            **checkpoint_fingerprints(),
        },
        "n_greedy": N_GREEDY,
        "images": {
            n: {"size": [w, h], "sha256_rgb": hashlib.sha256(make_image(w, h, seed).tobytes()).hexdigest()}
            for n, (w, h, seed) in IMAGES.items()
        },
        "cases": cases,
    }
    return results, index
