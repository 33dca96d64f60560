"""The control model: a tiny ``qwen3_vl`` checkpoint with random weights, built locally.

``qwen3_vl`` is mlx-vlm's own model of the family cohere_compass belongs to (MRoPE positions over
image grids, a deepstack vision tower) and ships on every pin we support. Driving it with the same
calls as ours on the same pin tells a pin's (or a host's) defect from ours: where the control is
right and ours is not, ours is at fault; where both are wrong, the pin is.

The checkpoint is model-only (config.json + model.safetensors in the Hugging Face key layout,
which every pin's ``sanitize`` maps): mlx-vlm's qwen3_vl processor goes through transformers'
Qwen processors, which want torchvision on several pins, so inputs are fed by hand
(:func:`control_prompt`). The weights come from the tiny cohere_compass builder's noise
(``compass_data.tiny``): IEEE-exact uniform noise, byte-identical on every machine.

References, all on the control itself and without any cache reuse across requests:
:func:`one_shot_logits` (the whole prompt in one forward pass, no cache),
:func:`recompute_greedy` (each step re-runs the whole sequence, no cache),
:func:`one_shot_greedy` (prefill with a fresh cache, then decode one token at a time, the plain
way every pin's ``generate_step`` does) and :func:`pin_greedy` (the pin's ``generate_step``).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from compass_data.tiny import _SCALES, _uniform_noise, save_safetensors, weights_sha256
from compass_data.tiny import VISION as TINY_VISION
from compass_data.weight_tree import weight_tree

MODEL_TYPE = "qwen3_vl"
VOCAB_SIZE = 256
# Special ids at the top of the small vocabulary; prompt text draws from [1, TEXT_ID_LIMIT).
VISION_START_ID, VISION_END_ID, IMAGE_ID, VIDEO_ID, VISION_PAD_ID, EOS_ID = 250, 251, 252, 253, 254, 255
TEXT_ID_LIMIT = 240

TEXT = dict(
    model_type="qwen3_vl_text",
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=VOCAB_SIZE,
    rms_norm_eps=1e-6,
    # A small base, so that positions (and so MRoPE mistakes) move the logits at these lengths.
    rope_theta=10000.0,
    max_position_embeddings=4096,
    # Sections of head_dim / 2 = 8 rotary pairs: t, h, w interleaved as in Qwen3-VL.
    rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True},
    tie_word_embeddings=False,
    attention_bias=False,
    hidden_act="silu",
)
# The tiny cohere_compass tower's sizes (its out_hidden_size is TEXT's hidden_size, 64), two layers.
VISION = dict(
    TINY_VISION,
    model_type=MODEL_TYPE,
    depth=2,
    deepstack_visual_indexes=[0, 1],
    hidden_act="gelu_pytorch_tanh",
)
PATCH_DIM = VISION["in_channels"] * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2

# Named cases: (text run lengths, image grids (t, h, w) in patches). Text runs alternate with
# images: run, image, run, image, ..., run. The two grids differ in shape so that the h and w
# position sections are told apart.
CASES: Dict[str, Tuple[Tuple[int, ...], Tuple[Tuple[int, int, int], ...]]] = {
    "text_short": ((9,), ()),
    "text_long": ((100,), ()),
    "image": ((5, 6), ((1, 4, 6),)),
    "two_images": ((4, 3, 5), ((1, 4, 6), (1, 6, 4))),
}

FINGERPRINT_FILE = "control.json"
FILES = ("config.json", "model.safetensors")


# --------------------------------------------------------------------------- checkpoint
def control_config() -> dict:
    """The control's config.json, shaped like a Hugging Face Qwen3-VL config."""
    return dict(
        architectures=["Qwen3VLForConditionalGeneration"],
        model_type=MODEL_TYPE,
        text_config=json.loads(json.dumps(TEXT)),
        vision_config=json.loads(json.dumps(VISION)),
        image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        vision_token_id=VISION_PAD_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )


def _hf_key(mlx_key: str) -> str:
    # The Hugging Face layout; every pin's Model.sanitize maps these prefixes back.
    for mlx_prefix, hf_prefix in (
        ("language_model.model.", "model.language_model."),
        ("vision_tower.", "model.visual."),
        ("language_model.lm_head.", "lm_head."),
    ):
        if mlx_key.startswith(mlx_prefix):
            return hf_prefix + mlx_key[len(mlx_prefix) :]
    raise AssertionError(f"{mlx_key} has no known prefix")


def control_weights(seed: int = 0) -> Dict[str, np.ndarray]:
    """Float32 weights of the control in the Hugging Face layout (Conv3d as torch's [O, C, T, P, P]).

    The tree is cohere_compass's (:func:`compass_data.weight_tree.weight_tree`) plus what
    qwen3_vl's sequential decoder layer adds: per-head query and key norms and a norm before the
    MLP. The strict load on every pin checks that the tree is complete.
    """
    tree = dict(weight_tree(TEXT, VISION, tied=False))
    for i in range(TEXT["num_hidden_layers"]):
        layer = f"language_model.model.layers.{i}."
        for name in ("q_norm", "k_norm"):
            tree[f"{layer}self_attn.{name}.weight"] = ((TEXT["head_dim"],), "norm")
        tree[f"{layer}post_attention_layernorm.weight"] = ((TEXT["hidden_size"],), "norm")
    scales = dict(_SCALES, **{"lm_head.weight": 0.15})
    weights = {}
    for key, (shape, kind) in sorted(tree.items()):
        hf = _hf_key(key)
        if kind == "conv":  # MLX [O, T, P, P, C] -> torch [O, C, T, P, P]
            shape = (shape[0], shape[4], shape[1], shape[2], shape[3])
        if kind == "norm":
            weights[hf] = _uniform_noise(seed, hf, shape, 0.1) + np.float32(1.0)
            continue
        std = next((s for suffix, s in scales.items() if key.endswith(suffix)), 0.05 if kind == "bias" else None)
        if std is None:
            raise AssertionError(f"no noise scale for {key}")
        weights[hf] = _uniform_noise(seed, hf, shape, std)
    return weights


def _sha256_file(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_control(folder: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write the control checkpoint into ``folder`` (created if needed) and return it.

    Idempotent: ``control.json`` records the seed, the weights' fingerprint (values, independent
    of the file) and each file's SHA-256; when all of them match, nothing is written.
    """
    folder = pathlib.Path(folder)
    weights = control_weights(seed)
    config = json.dumps(control_config(), indent=2) + "\n"
    expected = {"seed": seed, "weights_sha256": weights_sha256(weights), "config": control_config()}
    if _fingerprint_matches(folder, expected):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    # Written under a temporary name and renamed, so a reader never sees half a file.
    for name, write in (
        ("config.json", lambda path: path.write_text(config, encoding="utf-8")),
        ("model.safetensors", lambda path: save_safetensors(path, weights)),
    ):
        partial = folder / (name + ".partial")
        write(partial)
        partial.replace(folder / name)
    record = dict(expected, files={name: _sha256_file(folder / name) for name in FILES})
    (folder / FINGERPRINT_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return folder


def _fingerprint_matches(folder: pathlib.Path, expected: dict) -> bool:
    path = folder / FINGERPRINT_FILE
    if not path.is_file():
        return False
    record = json.loads(path.read_text(encoding="utf-8"))
    if {k: record.get(k) for k in expected} != expected:
        return False
    files = record.get("files", {})
    return all((folder / name).is_file() and _sha256_file(folder / name) == files.get(name) for name in FILES)


def load_control(folder: pathlib.Path):
    """The control's mlx-vlm ``Model`` (qwen3_vl), loaded by the pin's own ``load_model``."""
    from mlx_vlm.utils import load_model

    model = load_model(pathlib.Path(folder))
    if type(model).__module__.split(".")[-2:-1] != [MODEL_TYPE]:
        raise RuntimeError(f"expected mlx-vlm's {MODEL_TYPE} model, got {type(model).__module__}")
    return model


# --------------------------------------------------------------------------- inputs
def image_token_count(grid: Tuple[int, int, int]) -> int:
    """Merged image tokens a grid (t, h, w) in patches takes in the prompt."""
    t, h, w = grid
    merge = VISION["spatial_merge_size"]
    return t * (h // merge) * (w // merge)


def random_pixels(grids, seed: int = 0) -> np.ndarray:
    """Deterministic pixel rows [patches, C*T*P*P] in [-1, 1] (normalized values) for ``grids``."""
    rng = np.random.default_rng([seed, 1])
    rows = sum(t * h * w for t, h, w in grids)
    return (rng.random((rows, PATCH_DIM), dtype=np.float64) * 2.0 - 1.0).astype(np.float32)


def patchify(picture: np.ndarray) -> Tuple[np.ndarray, Tuple[int, int, int]]:
    """(pixel rows, grid) of an RGB uint8 picture [H, W, 3] whose sides are multiples of
    ``patch_size * spatial_merge_size``: normalized with mean = std = 0.5, the frame repeated
    over the temporal patch, rows ordered by merge block as Qwen's image processors order them."""
    p, m, tp = VISION["patch_size"], VISION["spatial_merge_size"], VISION["temporal_patch_size"]
    height, width, channels = picture.shape
    if channels != VISION["in_channels"] or height % (p * m) or width % (p * m):
        raise ValueError(f"picture must be [H, W, 3] with H and W multiples of {p * m}, got {picture.shape}")
    x = (picture.astype(np.float32) / np.float32(255.0) - np.float32(0.5)) / np.float32(0.5)
    frames = np.repeat(x.transpose(2, 0, 1)[None], tp, axis=0)  # [T, C, H, W]
    gh, gw = height // p, width // p
    x = frames.reshape(tp, channels, gh // m, m, p, gw // m, m, p)
    # -> [block row, block col, row in block, col in block, C, T, P, P]
    x = x.transpose(2, 5, 3, 6, 1, 0, 4, 7)
    return np.ascontiguousarray(x.reshape(gh * gw, PATCH_DIM)), (1, gh, gw)


def control_prompt(
    case: str,
    *,
    seed: int = 0,
    pixel_seed: Optional[int] = None,
    pixel_values: Optional[np.ndarray] = None,
) -> Dict[str, Any]:
    """Inputs of a named case (:data:`CASES`), ready for ``model(**inputs)``.

    ``input_ids`` [1, L] (text ids from ``seed``; each image as vision start, its merged image
    tokens, vision end), ``mask`` [1, L] of ones (the attention mask mlx-vlm's generate passes)
    and, for image cases, ``pixel_values`` [patches, C*T*P*P] and ``image_grid_thw`` [images, 3].
    Pixels are :func:`random_pixels` of ``pixel_seed`` (default: ``seed``) unless given.
    """
    import mlx.core as mx

    if case not in CASES:
        raise ValueError(f"unknown control case {case!r}; choose one of {sorted(CASES)}")
    runs, grids = CASES[case]
    rng = np.random.default_rng([seed, 0])
    ids: List[int] = []
    for i, run in enumerate(runs):
        ids += rng.integers(1, TEXT_ID_LIMIT, size=run).tolist()
        if i < len(grids):
            ids += [VISION_START_ID] + [IMAGE_ID] * image_token_count(grids[i]) + [VISION_END_ID]
    inputs: Dict[str, Any] = {
        "input_ids": mx.array([ids], dtype=mx.int32),
        "mask": mx.ones((1, len(ids)), dtype=mx.int32),
    }
    if grids:
        if pixel_values is None:
            pixel_values = random_pixels(grids, seed if pixel_seed is None else pixel_seed)
        expected_rows = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape != (expected_rows, PATCH_DIM):
            raise ValueError(
                f"{case} needs pixel_values of shape {(expected_rows, PATCH_DIM)}, got {pixel_values.shape}"
            )
        inputs["pixel_values"] = mx.array(pixel_values)
        inputs["image_grid_thw"] = mx.array(grids, dtype=mx.int32)
    return inputs


def expected_positions(inputs: Dict[str, Any]) -> np.ndarray:
    """MRoPE positions [3, L] of a prompt by Qwen3-VL's rule, by integer arithmetic: text runs
    count on by one; an image block takes (t, row, column) of its merged grid, offset by the
    position after the text before it; the text after it resumes past the block's largest."""
    ids = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
    grids = np.asarray(inputs["image_grid_thw"]).tolist() if "image_grid_thw" in inputs else []
    merge = VISION["spatial_merge_size"]
    out, nxt, i, image = [], 0, 0, 0
    while i < len(ids):
        if ids[i] != IMAGE_ID:
            out.append((nxt, nxt, nxt))
            nxt, i = nxt + 1, i + 1
            continue
        t, h, w = grids[image]
        h, w = h // merge, w // merge
        out += [(nxt + a, nxt + b, nxt + c) for a in range(t) for b in range(h) for c in range(w)]
        nxt += max(t, h, w)
        i, image = i + t * h * w, image + 1
    return np.array(out, dtype=np.int64).T


# --------------------------------------------------------------------------- references
def fresh_state(model) -> None:
    """Forget per-request state the pin keeps on the language model (the stored MRoPE delta and,
    on some pins, positions), as a freshly loaded model has it."""
    for name in ("_rope_deltas", "_position_ids"):
        if hasattr(model.language_model, name):
            setattr(model.language_model, name, None)


def _logits(output) -> Any:
    return getattr(output, "logits", output)


def one_shot_logits(model, inputs: Dict[str, Any]) -> np.ndarray:
    """Prefill logits [L, V] (float32): the whole prompt in one forward pass, no cache."""
    import mlx.core as mx

    fresh_state(model)
    logits = _logits(model(**inputs))
    return np.array(logits[0].astype(mx.float32))


def _with_ids(inputs: Dict[str, Any], ids: List[int]) -> Dict[str, Any]:
    import mlx.core as mx

    return dict(inputs, input_ids=mx.array([ids], dtype=mx.int32), mask=mx.ones((1, len(ids)), dtype=mx.int32))


def recompute_greedy(model, inputs: Dict[str, Any], steps: int) -> List[int]:
    """Greedy ids with no cache at all: each step re-runs the prompt plus the ids so far in one
    pass. Slow, but independent of any cache or stored position state."""
    import mlx.core as mx

    ids = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
    out: List[int] = []
    for _ in range(steps):
        fresh_state(model)
        logits = _logits(model(**_with_ids(inputs, ids + out)))
        out.append(int(mx.argmax(logits[0, -1]).item()))
    return out


def one_shot_greedy(model, inputs: Dict[str, Any], steps: int) -> List[int]:
    """Greedy ids the plain way: the whole prompt prefilled into a fresh cache in one call, then
    one token at a time through ``model.language_model``, as every pin's ``generate_step`` decodes."""
    import mlx.core as mx
    from mlx_vlm.models.cache import make_prompt_cache

    fresh_state(model)
    cache = make_prompt_cache(model.language_model)
    logits = _logits(model(**inputs, cache=cache))
    out = [int(mx.argmax(logits[0, -1]).item())]
    while len(out) < steps:
        logits = _logits(model.language_model(mx.array([[out[-1]]], dtype=mx.int32), cache=cache))
        out.append(int(mx.argmax(logits[0, -1]).item()))
    return out[:steps]


def pin_greedy(
    model,
    inputs: Dict[str, Any],
    steps: int,
    processors: Optional[List[Any]] = None,
    stop_at: Optional[int] = None,
) -> List[int]:
    """Greedy ids from the pin's own ``generate_step`` (temperature 0), fed the same inputs, with
    ``processors`` as its ``logits_processors``; ends after ``stop_at`` (an EOS id) as generate does."""
    from mlx_vlm.generate import generate_step

    fresh_state(model)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "mask")}
    if processors is not None:
        extra["logits_processors"] = processors
    stream = generate_step(
        inputs["input_ids"],
        model,
        inputs.get("pixel_values"),
        inputs["mask"],
        max_tokens=steps,
        temperature=0.0,
        **extra,
    )
    ids: List[int] = []
    for token, _ in stream:
        ids.append(int(np.asarray(token).reshape(-1)[0]))
        if len(ids) == steps or ids[-1] == stop_at:
            break
    return ids
