"""Every tensor a cohere_compass checkpoint holds, derived from its config by arithmetic.

The one enumeration of the weight tree: the tiny checkpoint builder and the full-size stand-in (``scripts/bench/build_fullsize.py``) all derive theirs from
:func:`weight_tree`. It is written independently of the model code; a test checks that the two
agree (``tests/test_broken_checkpoints.py::test_weight_tree_matches_the_model_tree``).

Self-contained (no imports outside the standard library), so scripts that must not import the
package (it patches mlx-vlm) can load it by path.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

Tree = Dict[str, Tuple[Tuple[int, ...], str]]

KINDS = ("linear", "embedding", "conv", "norm", "bias")
"""``linear`` / ``embedding``: quantizable by mlx-vlm's rule (the converter still skips the vision
tower); ``conv``: the patch embedding; ``norm``: a norm's scale; ``bias``: a bias or a norm's shift."""


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def weight_tree(text: Any, vision: Any, *, tied: bool) -> Tree:
    """``{MLX-layout key: (shape, kind)}`` for a text and a vision config (objects or dicts).

    ``tied``: the output head is the embedding (no ``language_model.lm_head``). The patch
    embedding's shape is MLX's ``[O, T, P, P, C]``.
    """
    d = _get(text, "hidden_size")
    heads = _get(text, "num_attention_heads")
    hd = _get(text, "head_dim") or d // heads
    q, kv = heads * hd, _get(text, "num_key_value_heads") * hd
    inter = _get(text, "intermediate_size")
    attention_bias = bool(_get(text, "attention_bias", False))
    out: Tree = {}

    def linear(prefix: str, n_out: int, n_in: int, bias: bool) -> None:
        out[prefix + ".weight"] = ((n_out, n_in), "linear")
        if bias:
            out[prefix + ".bias"] = ((n_out,), "bias")

    lm = "language_model.model."
    out[lm + "embed_tokens.weight"] = ((_get(text, "vocab_size"), d), "embedding")
    for i in range(_get(text, "num_hidden_layers")):
        p = f"{lm}layers.{i}."
        out[p + "input_layernorm.weight"] = ((d,), "norm")
        for name, n_out, n_in in (("q_proj", q, d), ("k_proj", kv, d), ("v_proj", kv, d), ("o_proj", d, q)):
            linear(p + "self_attn." + name, n_out, n_in, attention_bias)
        for name, n_out, n_in in (("gate_proj", inter, d), ("up_proj", inter, d), ("down_proj", d, inter)):
            linear(p + "mlp." + name, n_out, n_in, False)
    out[lm + "norm.weight"] = ((d,), "norm")
    if not tied:
        linear("language_model.lm_head", _get(text, "vocab_size"), d, False)

    vd, vi = _get(vision, "hidden_size"), _get(vision, "intermediate_size")
    merged = vd * _get(vision, "spatial_merge_size") ** 2
    patch, frames = _get(vision, "patch_size"), _get(vision, "temporal_patch_size")
    vt = "vision_tower."
    out[vt + "patch_embed.proj.weight"] = ((vd, frames, patch, patch, _get(vision, "in_channels")), "conv")
    out[vt + "patch_embed.proj.bias"] = ((vd,), "bias")
    out[vt + "pos_embed.weight"] = ((_get(vision, "num_position_embeddings"), vd), "embedding")
    for i in range(_get(vision, "depth")):
        p = f"{vt}blocks.{i}."
        for norm in ("norm1", "norm2"):
            out[p + norm + ".weight"] = ((vd,), "norm")
            out[p + norm + ".bias"] = ((vd,), "bias")
        linear(p + "attn.qkv", 3 * vd, vd, True)
        linear(p + "attn.proj", vd, vd, True)
        linear(p + "mlp.linear_fc1", vi, vd, True)
        linear(p + "mlp.linear_fc2", vd, vi, True)
    mergers = [("merger.", vd)] + [
        (f"deepstack_merger_list.{k}.", merged) for k in range(len(_get(vision, "deepstack_visual_indexes")))
    ]
    for p, norm_dim in mergers:
        out[vt + p + "norm.weight"] = ((norm_dim,), "norm")
        out[vt + p + "norm.bias"] = ((norm_dim,), "bias")
        linear(vt + p + "linear_fc1", merged, merged, True)
        linear(vt + p + "linear_fc2", _get(vision, "out_hidden_size"), merged, True)
    return out
