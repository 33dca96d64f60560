"""A tiny, deterministic cohere_compass checkpoint for tests (no torch, no network).

``build_tiny_checkpoint(path)`` writes a complete checkpoint folder with the published file set:
config.json (``tie_word_embeddings`` at the top level and in ``text_config``),
generation_config.json, preprocessor_config.json (the published values), the committed tiny
tokenizer (``compass_data/tiny_tokenizer``, built by ``scripts/package_data/tiny_tokenizer.py``:
tokenizer.json, tokenizer_config.json with its ``min_pixels``/``max_pixels``, chat_template.jinja)
and model.safetensors in either weight layout:

- ``"original"``: CohereLabs key names (``model.language_model.*``, ``model.visual.*``), the
  Conv3d patch embedding in torch layout ``[O, C, T, P, P]``, no ``lm_head`` (tied);
- ``"mlx"``: MLX-conversion key names (``language_model.model.*``, ``vision_tower.*``), the
  Conv3d weight in MLX layout ``[O, T, P, P, C]``, plus the processor_config.json that
  mlx-vlm >= 0.6.13's converter writes (its nested ``image_processor`` block is what
  transformers reads first).

As in the published checkpoint, ``vocab_size`` exceeds the tokenizer: the embedding rows past
it (``PADDED_VOCAB_SIZE - tokenizer_vocab_size()``) are padding no token maps to.

Both hold the same values. Weights are drawn from numpy's PCG64 (``default_rng``) as uniform
noise of a chosen standard deviation, using only IEEE-exact arithmetic, and written by a small
safetensors writer of our own, so the files are byte-identical on every machine and with every
safetensors version. ``weights_sha256`` fingerprints the values independently of layout and
storage dtype; the reference fixtures record it so that drift is detected.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import pathlib
import shutil
import struct
import zlib
from typing import Dict, Iterator, List, Mapping, Tuple

import numpy as np

from .weight_tree import weight_tree

TOKENIZER_DIR = pathlib.Path(__file__).resolve().parent / "tiny_tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Embedding rows; the tokenizer has 512 entries (published: 262144 rows, 255035 entries).
PADDED_VOCAB_SIZE = 576

LAYOUTS = ("original", "mlx")
DTYPES = ("float32", "bfloat16")
VARIANTS = ("default", "small_max_pixels", "alt_attention")
# "alt_attention": another text config on the same tensor shapes (alternating layer types,
# a shorter sliding window, another rotary base) plus small max pixels, so two checkpoints in
# one process differ in everything but their weight shapes. "default" is never changed.
ALT_ATTENTION_TEXT = dict(
    layer_types=["sliding_attention", "full_attention"] * 4,
    sliding_window=8,
    rope_theta=20000.0,
)

# Key prefixes of the two layouts (original -> mlx).
PREFIXES = (("model.language_model.", "language_model.model."), ("model.visual.", "vision_tower."))
PATCH_EMBED = "model.visual.patch_embed.proj.weight"

TEXT = dict(
    hidden_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    sliding_window=16,
    layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
    logit_scale=0.25,
    layer_norm_eps=1e-5,
)
VISION = dict(
    depth=4,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
    num_position_embeddings=64,
    deepstack_visual_indexes=[0, 2, 3],
    in_channels=3,
)


# --------------------------------------------------------------------------- tokenizer ids
def special_token_ids() -> Dict[str, int]:
    """Ids of the tiny tokenizer's special tokens, read from the committed tokenizer.json."""
    data = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    return {t["content"]: t["id"] for t in data["added_tokens"]}


def tokenizer_vocab_size() -> int:
    data = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data["added_tokens"]]
    return max(ids) + 1


# --------------------------------------------------------------------------- configs
def mrope_parameters(section: List[int], theta: float = 50000.0) -> dict:
    """The text config's rope_parameters as published: interleaved MRoPE on sliding layers, none on full ones."""
    sliding = {"rope_type": "default", "rope_theta": theta, "mrope_section": list(section), "mrope_interleaved": True}
    return {"sliding_attention": sliding, "full_attention": None}


def vision_config() -> dict:
    """The tiny checkpoint's vision_config (without its test-only key)."""
    return dict(
        model_type="cohere_compass_vision",
        **copy.deepcopy(VISION),
        hidden_act="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
        initializer_range=0.02,
    )


def tiny_config(variant: str = "default", dtype: str = "float32") -> dict:
    """The config.json of the tiny checkpoint."""
    _check("variant", variant, VARIANTS)
    ids = special_token_ids()
    eos, pad, bos = ids["<|END_OF_TURN_TOKEN|>"], ids["<PAD>"], ids["<BOS_TOKEN>"]
    text = dict(
        model_type="cohere_compass_text",
        vocab_size=PADDED_VOCAB_SIZE,
        **copy.deepcopy(TEXT),
        hidden_act="silu",
        max_position_embeddings=4096,
        attention_bias=False,
        attention_dropout=0.0,
        # With a stray entry, as in the published hub config; the reference drops it.
        rope_parameters=dict(mrope_parameters([4, 2, 2]), rope_theta=10000.0),
        tie_word_embeddings=True,
        use_cache=True,
        initializer_range=0.02,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        compass_compat_unknown_text_key="loaders must ignore this",
    )
    vision = dict(vision_config(), compass_compat_unknown_vision_key=[1, 2, 3])
    if variant == "alt_attention":
        text["layer_types"] = list(ALT_ATTENTION_TEXT["layer_types"])
        text["sliding_window"] = ALT_ATTENTION_TEXT["sliding_window"]
        text["rope_parameters"]["sliding_attention"]["rope_theta"] = ALT_ATTENTION_TEXT["rope_theta"]
    return dict(
        architectures=["CohereCompassForConditionalGeneration"],
        model_type="cohere_compass",
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|IMAGE_PAD|>"],
        video_token_id=ids["<|VIDEO_PAD|>"],
        vision_start_token_id=ids["<|VISION_START|>"],
        vision_end_token_id=ids["<|VISION_END|>"],
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype=dtype,
        fusion_config={"patch_embeddings": True},
        compass_compat_unknown_top_key={"nested": {"ignored": True}},
    )


def strip_test_keys(config: dict) -> dict:
    """A copy of ``config`` without the ``compass_compat_unknown_*`` keys (at every level) that
    the tiny checkpoint carries so that loaders are tested to ignore unknown keys."""

    def clean(block: dict) -> dict:
        return {k: v for k, v in block.items() if not k.startswith("compass_compat_unknown_")}

    out = clean(copy.deepcopy(config))
    for level in ("text_config", "vision_config"):
        out[level] = clean(out[level])
    return out


def tiny_pixel_bounds(variant: str = "default") -> Tuple[int, int]:
    """(min_pixels, max_pixels) the processor uses: tokenizer_config.json's, scaled to tiny images."""
    _check("variant", variant, VARIANTS)
    return 16384, (65536 if variant in ("small_max_pixels", "alt_attention") else 602112)


PUBLISHED_IMAGE_PROCESSOR = dict(
    do_convert_rgb=True,
    do_resize=True,
    resample=3,
    size={"shortest_edge": 65536, "longest_edge": 16777216},
    do_rescale=True,
    rescale_factor=1 / 255,
    do_normalize=True,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
)
"""The image processor settings of the published preprocessor_config.json."""


def tiny_preprocessor_config(variant: str = "default") -> dict:
    """preprocessor_config.json with the published values (its size is overridden by the
    tokenizer_config.json pixel bounds, as in the published checkpoint).

    The other variants carry a non-default mean/std, so that a processor ignoring this file
    (the published values are the class defaults) shows up.
    """
    _check("variant", variant, VARIANTS)
    config = dict(
        image_processor_type="CohereCompassImageProcessor",
        processor_class="CohereCompassProcessor",
        **copy.deepcopy(PUBLISHED_IMAGE_PROCESSOR),
    )
    if variant != "default":
        config.update(image_mean=[0.48, 0.46, 0.41], image_std=[0.27, 0.26, 0.28])
    return config


def tiny_tokenizer_config(variant: str = "default") -> dict:
    """The committed tokenizer_config.json with the variant's pixel bounds."""
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["min_pixels"], config["max_pixels"] = tiny_pixel_bounds(variant)
    return config


def tiny_processor_config(variant: str = "default") -> dict:
    """processor_config.json as mlx-vlm >= 0.6.13's converter writes it: the image processor's
    settings nested, with the bounds it resolved (min/max_pixels and size agree)."""
    low, high = tiny_pixel_bounds(variant)
    block = {k: v for k, v in tiny_preprocessor_config(variant).items() if k not in ("processor_class", "resample")}
    block.update(min_pixels=low, max_pixels=high, size={"shortest_edge": low, "longest_edge": high})
    return {"image_processor": block, "processor_class": "CohereCompassProcessor"}


def tiny_generation_config() -> dict:
    """generation_config.json with the published stop token and sampling defaults."""
    ids = special_token_ids()
    return dict(
        bos_token_id=ids["<BOS_TOKEN>"],
        eos_token_id=ids["<|END_OF_TURN_TOKEN|>"],
        pad_token_id=ids["<PAD>"],
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
    )


# --------------------------------------------------------------------------- weights
# Noise standard deviation per tensor (MLX-layout key suffix; first match wins). They keep
# activations O(1) while attention is far from uniform and greedy argmax is decisive, yet small
# enough that float32 summation-order noise stays well below the 1e-4 logit tolerance at image
# positions (measured against the reference by scripts/reference/model_outputs.py).
_SCALES = (
    ("embed_tokens.weight", 1.2),
    ("q_proj.weight", 0.2),
    ("k_proj.weight", 0.2),
    ("v_proj.weight", 0.15),
    ("o_proj.weight", 0.18),
    ("gate_proj.weight", 0.15),
    ("up_proj.weight", 0.15),
    ("down_proj.weight", 0.18),
    ("patch_embed.proj.weight", 0.03),
    ("patch_embed.proj.bias", 0.1),
    ("pos_embed.weight", 0.5),
    ("attn.qkv.weight", 0.12),
    ("attn.proj.weight", 0.15),
    ("mlp.linear_fc1.weight", 0.12),
    ("mlp.linear_fc2.weight", 0.12),
    ("linear_fc1.weight", 0.1),  # the mergers
    ("linear_fc2.weight", 0.1),
)


def _weight_specs() -> Iterator[Tuple[str, Tuple[int, ...], str, float]]:
    """(original-layout key, shape, kind, scale) of every tensor, from the one weight tree
    (:func:`compass_data.weight_tree.weight_tree`).

    kind "noise": uniform noise with standard deviation ``scale``; "norm": ``1 + noise``
    (a norm's scale, std 0.1). Biases and norm shifts: std 0.05.
    """
    text = dict(TEXT, vocab_size=PADDED_VOCAB_SIZE)
    for key, (shape, kind) in weight_tree(text, VISION, tied=True).items():
        if _original_key(key) == key:
            raise AssertionError(f"{key} has no original-layout prefix")
        if kind == "norm":
            yield _original_key(key), shape, "norm", 0.1
            continue
        if kind == "conv":  # MLX [O, T, P, P, C] -> torch [O, C, T, P, P]
            shape = (shape[0], shape[4], shape[1], shape[2], shape[3])
        scale = next((std for suffix, std in _SCALES if key.endswith(suffix)), 0.05 if kind == "bias" else None)
        if scale is None:
            raise AssertionError(f"no noise scale for {key}")
        yield _original_key(key), shape, "noise", scale


def _original_key(key: str) -> str:
    """An MLX-layout key in the original layout (keys with neither prefix unchanged)."""
    for src, dst in PREFIXES:
        if key.startswith(dst):
            return src + key[len(dst) :]
    return key


def _uniform_noise(seed: int, key: str, shape: Tuple[int, ...], std: float) -> np.ndarray:
    # One stream per tensor (seeded by the key's CRC32), so adding a tensor changes no other.
    # Uniform noise needs only IEEE-exact arithmetic: identical float32 values everywhere.
    rng = np.random.default_rng([seed, zlib.crc32(key.encode("utf-8"))])
    u = rng.random(int(np.prod(shape)), dtype=np.float64)
    return ((u * 2.0 - 1.0) * (std * math.sqrt(3.0))).astype(np.float32).reshape(shape)


def tiny_weights(seed: int = 0) -> Dict[str, np.ndarray]:
    """Float32 weights of the tiny model in the original (CohereLabs) layout."""
    weights = {}
    for key, shape, kind, scale in _weight_specs():
        w = _uniform_noise(seed, key, shape, scale)
        weights[key] = (w + np.float32(1.0)) if kind == "norm" else w
    # A small end-of-turn row keeps it from winning the greedy argmax (the head is tied),
    # so generation through mlx-vlm, which stops there, runs the full 32 tokens.
    embed = weights["model.language_model.embed_tokens.weight"]
    embed[special_token_ids()["<|END_OF_TURN_TOKEN|>"]] *= np.float32(0.25)
    # Padding rows small, so no greedy step lands on an id the tokenizer cannot decode.
    embed[tokenizer_vocab_size() :] *= np.float32(0.1)
    return weights


def to_mlx_layout(weights: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Rename original-layout keys to the MLX-conversion layout; Conv3d to [O, T, P, P, C]."""
    out = {}
    for key, value in weights.items():
        if key == PATCH_EMBED:
            value = np.ascontiguousarray(value.transpose(0, 2, 3, 4, 1))
        for src, dst in PREFIXES:
            if key.startswith(src):
                key = key.replace(src, dst, 1)
                break
        out[key] = value
    return out


def from_mlx_layout(weights: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Inverse of :func:`to_mlx_layout`."""
    out = {}
    for key, value in weights.items():
        key = _original_key(key)
        if key == PATCH_EMBED:
            value = np.ascontiguousarray(value.transpose(0, 4, 1, 2, 3))
        out[key] = value
    return out


def weights_sha256(weights: Mapping[str, np.ndarray]) -> str:
    """Fingerprint of original-layout float32 values (name, shape and bytes of every tensor)."""
    h = hashlib.sha256()
    for key in sorted(weights):
        value = np.ascontiguousarray(np.asarray(weights[key], dtype=np.float32))
        h.update(f"{key}|{list(value.shape)}|".encode("utf-8"))
        h.update(value.astype("<f4").tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- safetensors
def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even (finite inputs)."""
    bits = np.ascontiguousarray(x, dtype="<f4").view("<u4").astype(np.uint64)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).astype("<u2")


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype="<u2").astype("<u4") << 16).view("<f4")


def save_safetensors(path: pathlib.Path, tensors: Mapping[str, np.ndarray], dtype: str = "float32") -> None:
    """Write a safetensors file (8-byte header size, JSON header, raw little-endian data).

    Tensors are laid out in sorted key order. ``dtype="bfloat16"`` rounds the float32 values.
    """
    _check("dtype", dtype, DTYPES)
    header: Dict[str, object] = {"__metadata__": {"format": "pt"}}
    chunks, offset = [], 0
    for key in sorted(tensors):
        value = np.asarray(tensors[key], dtype=np.float32)
        data = to_bfloat16_bits(value) if dtype == "bfloat16" else value.astype("<f4")
        raw = np.ascontiguousarray(data).tobytes()
        header[key] = {
            "dtype": "BF16" if dtype == "bfloat16" else "F32",
            "shape": list(value.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for raw in chunks:
            f.write(raw)


# --------------------------------------------------------------------------- builder
def build_tiny_checkpoint(
    path,
    *,
    layout: str = "original",
    dtype: str = "float32",
    seed: int = 0,
    variant: str = "default",
) -> pathlib.Path:
    """Write the tiny checkpoint folder at ``path`` (created if needed) and return it."""
    return write_checkpoint(
        path, tiny_config(variant, dtype), tiny_weights(seed), layout=layout, dtype=dtype, variant=variant
    )


def write_checkpoint(
    path,
    config: dict,
    weights: Mapping[str, np.ndarray],
    *,
    layout: str = "original",
    dtype: str = "float32",
    variant: str = "default",
) -> pathlib.Path:
    """Write a checkpoint folder with the tiny file set: ``config`` and original-layout ``weights``
    (stored in ``layout`` and ``dtype``), the variant's processor files and the tiny tokenizer."""
    _check("layout", layout, LAYOUTS)
    _check("dtype", dtype, DTYPES)
    _check("variant", variant, VARIANTS)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)

    def dump(name: str, obj: dict) -> None:
        (path / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")

    dump("config.json", config)
    dump("preprocessor_config.json", tiny_preprocessor_config(variant))
    dump("generation_config.json", tiny_generation_config())
    if layout == "mlx":
        dump("processor_config.json", tiny_processor_config(variant))
    for name in TOKENIZER_FILES:
        if name == "tokenizer_config.json":
            dump(name, tiny_tokenizer_config(variant))
        else:
            shutil.copyfile(TOKENIZER_DIR / name, path / name)

    if layout == "mlx":
        weights = to_mlx_layout(weights)
    save_safetensors(path / "model.safetensors", weights, dtype)
    return path


def _check(name: str, value: str, allowed: Tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
