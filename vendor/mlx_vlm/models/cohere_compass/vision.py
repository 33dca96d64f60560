"""Vision tower of cohere_compass (Qwen3-VL shape, axial 2-D rotary): transformers'
``CohereCompassVisionModel``, with its parameter names (checkpoints load with ``strict=True``)."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .config import VisionConfig, grid_sequence

# transformers' ACT2FN names -> MLX functions with the same formula.
_BLOCK_ACTIVATIONS = {
    "gelu": nn.gelu,  # exact erf GELU
    "gelu_pytorch_tanh": nn.gelu_approx,  # tanh approximation
    "gelu_new": nn.gelu_approx,  # same tanh formula, written out in Python upstream
}
# transformers maps "default" to "axial" for old checkpoints; anything else it rejects.
_ROPE_TYPES = (None, "default", "axial")
_LN_EPS = 1e-6
_CONV_WEIGHT = "vision_tower.patch_embed.proj.weight"


def _block_activation(name: str):
    try:
        return _BLOCK_ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"vision_config.hidden_act {name!r} is not supported; expected one of {sorted(_BLOCK_ACTIVATIONS)}"
        ) from None


class _Layout:
    """Per-call index tables (numpy, built once per call, shared by every block)."""

    def __init__(self, grids: Sequence[Tuple[int, int, int]], side: int, merge: int):
        rows, cols, taps, weights, seqlens = [], [], [], [], []
        for t, h, w in grids:
            if t < 1 or h % merge or w % merge:
                raise ValueError(
                    f"grid_thw ({t}, {h}, {w}) must have t >= 1 and h, w divisible by spatial_merge_size {merge}"
                )
            # Raster index of every token of one frame, in merge-window order.
            raster = (
                np.arange(h * w)
                .reshape(h // merge, merge, w // merge, merge)
                .transpose(0, 2, 1, 3)
                .reshape(-1)
            )
            r, c = raster // w, raster % w
            r0, r1, fr = _axis_taps(r, h, side)
            c0, c1, fc = _axis_taps(c, w, side)
            tap = np.stack(
                [r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], -1
            )
            wt = np.stack(
                [(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], -1
            )
            # Frames repeat the spatial tables and attend only within themselves.
            rows.append(np.tile(r, t))
            cols.append(np.tile(c, t))
            taps.append(np.tile(tap, (t, 1)))
            weights.append(np.tile(wt, (t, 1)))
            seqlens += [h * w] * t
        self.rows = np.concatenate(rows)
        self.cols = np.concatenate(cols)
        self.taps = np.concatenate(taps).astype(np.int32)
        self.weights = np.concatenate(weights).astype(np.float32)
        self.num_patches = int(sum(seqlens))
        self.runs = _equal_length_runs(seqlens)


def _axis_taps(coord: np.ndarray, size: int, side: int):
    # align_corners: output ends land on table ends; size 1 samples entry 0.
    src = coord * (side - 1) / max(size - 1, 1)
    lo = np.floor(src).astype(np.int64)
    frac = (src - lo).astype(np.float32)
    hi = np.minimum(lo + 1, side - 1)
    return lo, hi, frac


def _equal_length_runs(seqlens: List[int]) -> List[Tuple[int, int, int]]:
    """(start, count, length) for each run of consecutive equal-length segments."""
    runs, start = [], 0
    for n in seqlens:
        if runs and runs[-1][2] == n:
            s, k, _ = runs[-1]
            runs[-1] = (s, k + 1, n)
        else:
            runs.append((start, 1, n))
        start += n
    return runs


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(
            config.in_channels,
            config.hidden_size,
            kernel_size=kernel,
            stride=kernel,
            bias=True,
        )

    def __call__(self, pixel_values: mx.array) -> mx.array:
        # kernel == stride, so the conv is one matmul per patch. Reorder the weight from
        # MLX [O, T, P, P, C] to [C*T*P*P, O] (the processor's flattening) as a contiguous
        # copy: a transposed operand is slow on CPU BLAS.
        weight = self.proj.weight
        weight = weight.transpose(4, 1, 2, 3, 0).reshape(-1, weight.shape[0])
        x = pixel_values.reshape(-1, weight.shape[0]).astype(weight.dtype)
        return mx.addmm(self.proj.bias, x, weight)


class Attention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, runs) -> mx.array:
        n, dim = x.shape
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim)
        qk = _rotate(qkv[:, :2], cos, sin).astype(x.dtype)
        q, k, v = qk[:, 0], qk[:, 1], qkv[:, 2]
        outs = []
        for start, count, length in runs:
            # Equal-length segments (frames, same-size images) share one batched call.
            seg = [
                a[start : start + count * length]
                .reshape(count, length, self.num_heads, self.head_dim)
                .transpose(0, 2, 1, 3)
                for a in (q, k, v)
            ]
            o = mx.fast.scaled_dot_product_attention(*seg, scale=self.scale)
            outs.append(o.transpose(0, 2, 1, 3).reshape(count * length, dim))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        return self.proj(out)


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    # Rotate-half in float32 as the reference; cos/sin hold one half (the halves repeat).
    x = x.astype(mx.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class MLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(
            config.hidden_size, config.intermediate_size, bias=True
        )
        self.linear_fc2 = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=True
        )
        self.act = _block_activation(config.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=_LN_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=_LN_EPS)
        self.attn = Attention(config)
        self.mlp = MLP(config)

    def __call__(self, x, cos, sin, runs):
        x = x + self.attn(self.norm1(x), cos, sin, runs)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """2x2 (merge x merge) token merge -> out_hidden_size; the GELU here is the exact one."""

    def __init__(self, config: VisionConfig, norm_after_merge: bool):
        super().__init__()
        self._merged = config.hidden_size * config.spatial_merge_size**2
        self._norm_after_merge = norm_after_merge
        self.norm = nn.LayerNorm(
            self._merged if norm_after_merge else config.hidden_size, eps=_LN_EPS
        )
        self.linear_fc1 = nn.Linear(self._merged, self._merged, bias=True)
        self.linear_fc2 = nn.Linear(self._merged, config.out_hidden_size, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        if self._norm_after_merge:
            x = self.norm(x.reshape(-1, self._merged))
        else:
            x = self.norm(x).reshape(-1, self._merged)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        rope_type = (config.rope_parameters or {}).get("rope_type")
        if rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"vision_config.rope_parameters.rope_type {rope_type!r} is not supported; "
                "the vision tower uses the 'axial' rotation"
            )
        if config.head_dim % 4:
            raise ValueError(
                f"vision head_dim ({config.head_dim} = hidden_size / num_heads) must be a "
                "multiple of 4 for the axial (row, column) rotary"
            )

        self._side = int(round(config.num_position_embeddings**0.5))
        self._merge = config.spatial_merge_size
        quarter = config.head_dim // 4
        # Row and column share these frequencies; not a parameter (absent from checkpoints).
        self._inv_freq = 1.0 / (
            config.rope_theta
            ** (mx.arange(0, 2 * quarter, 2, dtype=mx.float32) / (2 * quarter))
        )
        # Same lookup as the reference: the k-th listed index uses merger k.
        indexes = list(config.deepstack_visual_indexes)
        self._deepstack_at = {i: indexes.index(i) for i in indexes}

        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(
            config.num_position_embeddings, config.hidden_size
        )
        self.blocks = [VisionBlock(config) for _ in range(config.depth)]
        self.merger = PatchMerger(config, norm_after_merge=False)
        self.deepstack_merger_list = [
            PatchMerger(config, norm_after_merge=True) for _ in indexes
        ]

    def __call__(
        self, pixel_values: mx.array, grid_thw
    ) -> Tuple[mx.array, List[mx.array]]:
        layout = _Layout(list(grid_sequence(grid_thw)), self._side, self._merge)
        if pixel_values.shape[0] != layout.num_patches:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} patches but grid_thw describes {layout.num_patches}"
            )
        x = self.patch_embed(pixel_values)
        # Weighted sum in float32 (f32 weights promote), as the reference.
        pos = (
            self.pos_embed(mx.array(layout.taps)) * mx.array(layout.weights)[..., None]
        )
        x = x + pos.sum(axis=1).astype(x.dtype)

        positions = mx.array(
            np.stack([layout.rows, layout.cols], -1).astype(np.float32)
        )
        angles = (positions[..., None] * self._inv_freq).reshape(
            layout.num_patches, 1, 1, -1
        )
        cos, sin = mx.cos(angles), mx.sin(angles)

        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, layout.runs)
            k = self._deepstack_at.get(i)
            if k is not None:
                deepstack.append(self.deepstack_merger_list[k](x))
        return self.merger(x), deepstack

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        out = {
            k: v for k, v in weights.items() if k.rsplit(".", 1)[-1] != "position_ids"
        }
        if _CONV_WEIGHT in out:
            out[_CONV_WEIGHT] = self._conv_weight_to_mlx(out[_CONV_WEIGHT])
        return out

    def _conv_weight_to_mlx(self, w):
        c = self.config
        mlx_shape = (c.temporal_patch_size, c.patch_size, c.patch_size, c.in_channels)
        torch_shape = (c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        # Checked first: when both layouts have the same shape nothing can tell them apart,
        # and leaving the weight alone keeps sanitize idempotent.
        if tuple(w.shape[1:]) == mlx_shape:
            return w
        if tuple(w.shape[1:]) == torch_shape:
            return w.transpose(0, 2, 3, 4, 1)
        raise ValueError(
            f"{_CONV_WEIGHT} has shape {tuple(w.shape)}; expected [O, {', '.join(map(str, mlx_shape))}] "
            f"(MLX) or [O, {', '.join(map(str, torch_shape))}] (torch) for this vision_config"
        )
