"""Configuration of cohere_compass: unknown ``config.json`` keys are ignored, values the model
cannot run with raise :class:`ValueError` naming the key."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

LAYER_TYPES = ("sliding_attention", "full_attention")
DEFAULT_MROPE_SECTION = (24, 20, 20)


def _known_fields(cls, params: Dict[str, Any]) -> Dict[str, Any]:
    names = inspect.signature(cls).parameters
    return {k: v for k, v in params.items() if k in names}


@dataclass(frozen=True)
class RopeSpec:
    """Rotation applied by one layer type: base ``theta`` and the MRoPE ``section``."""

    theta: float
    mrope_section: tuple


@dataclass
class VisionConfig:
    model_type: str = "cohere_compass_vision"
    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: List[int] = field(default_factory=lambda: [8, 16, 24])
    rope_parameters: Optional[Dict[str, Any]] = None
    # rope_parameters' rope_theta, else this key, else 10000.
    rope_theta: Optional[float] = None

    @classmethod
    def from_dict(cls, params: Dict[str, Any]) -> "VisionConfig":
        return cls(**_known_fields(cls, params or {}))

    def __post_init__(self):
        theta = (self.rope_parameters or {}).get("rope_theta", self.rope_theta)
        self.rope_theta = float(theta) if theta is not None else 10000.0
        # Very old checkpoints name the vision config "cohere_compass"; accept it.
        if self.model_type == "cohere_compass":
            self.model_type = "cohere_compass_vision"
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision_config.hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        side = int(round(self.num_position_embeddings**0.5))
        if side * side != self.num_position_embeddings:
            raise ValueError(
                "vision_config.num_position_embeddings must be a square number "
                f"(a side x side grid), got {self.num_position_embeddings}"
            )
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(
                f"vision_config.deepstack_visual_indexes {bad} lie outside the {self.depth} vision blocks"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class TextConfig:
    model_type: str = "cohere_compass_text"
    vocab_size: int = 256000
    hidden_size: int = 8192
    intermediate_size: int = 22528
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    layer_norm_eps: float = 1e-5
    # None when config.json's text_config has no such key (see ModelConfig.head_tied).
    tie_word_embeddings: Optional[bool] = None
    rope_parameters: Optional[Dict[str, Any]] = None
    rope_theta: Optional[float] = None
    attention_bias: bool = False
    sliding_window: Optional[int] = 4096
    layer_types: Optional[List[str]] = None
    logit_scale: Optional[float] = None
    pad_token_id: Optional[int] = 0
    bos_token_id: Optional[int] = 5
    eos_token_id: Any = 255001

    @classmethod
    def from_dict(cls, params: Dict[str, Any]) -> "TextConfig":
        return cls(**_known_fields(cls, params or {}))

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        # A head_dim key overrides hidden_size // num_attention_heads, as transformers 5.24 reads it.
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"text_config.hidden_size ({self.hidden_size}) must be divisible by "
                    f"num_attention_heads ({self.num_attention_heads}), or give head_dim"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(
                f"text_config.head_dim must be a positive even number, got {self.head_dim}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"text_config.num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        # As the reference: no layer_types means every layer is full attention.
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"text_config.layer_types has {len(self.layer_types)} entries but "
                f"num_hidden_layers is {self.num_hidden_layers}; give one type per layer"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(
                f"text_config.layer_types has unknown types {unknown}; expected only {list(LAYER_TYPES)}"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError(
                "text_config.sliding_window must be a positive integer when layer_types contains sliding_attention"
            )
        for layer_type in set(self.layer_types):
            spec = self.rope_for(layer_type)
            if spec is not None and sum(spec.mrope_section) != self.head_dim // 2:
                raise ValueError(
                    f"text_config.rope_parameters[{layer_type!r}].mrope_section "
                    f"{list(spec.mrope_section)} sums to {sum(spec.mrope_section)}, "
                    f"but head_dim // 2 is {self.head_dim // 2}"
                )

    @property
    def rope_scaling(self) -> Optional[Dict[str, Any]]:
        """The sliding layers' rotation in Qwen-VL's flat form (read-only): hosts (oMLX, mlx-vlm's
        servers) keep per-request MRoPE state when ``"mrope_section" in rope_scaling``."""
        for layer_type in LAYER_TYPES:
            spec = self.rope_for(layer_type) if layer_type in self.layer_types else None
            if spec is not None:
                return {
                    "rope_type": "default",
                    "rope_theta": spec.theta,
                    "mrope_section": list(spec.mrope_section),
                    "mrope_interleaved": True,
                }
        return None

    def rope_for(self, layer_type: str) -> Optional[RopeSpec]:
        """The rotation of ``layer_type`` layers, or None: per-layer-type ``rope_parameters`` (a null
        or missing entry: none; stray top-level keys beside them ignored), else a flat
        ``rope_parameters`` or bare ``rope_theta`` for every layer type."""
        params = self.rope_parameters or {}
        if not set(params).isdisjoint(LAYER_TYPES):
            entry = params.get(layer_type)
            if entry is None:
                return None
            return self._spec(entry)
        if params or self.rope_theta is not None:
            return self._spec({"rope_theta": self.rope_theta, **params})
        return None

    def _spec(self, entry: Dict[str, Any]) -> RopeSpec:
        rope_type = entry.get("rope_type", entry.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"text_config rope_type {rope_type!r} is not supported; cohere_compass uses the 'default' rotation"
            )
        theta = entry.get("rope_theta")
        if theta is None:
            theta = self.rope_theta if self.rope_theta is not None else 10000.0
        section = tuple(entry.get("mrope_section") or DEFAULT_MROPE_SECTION)
        if len(section) != 3:
            raise ValueError(
                f"mrope_section must have 3 entries (t, h, w), got {list(section)}"
            )
        return RopeSpec(theta=float(theta), mrope_section=section)


@dataclass
class ModelConfig:
    text_config: TextConfig = field(default_factory=TextConfig)
    vision_config: VisionConfig = field(default_factory=VisionConfig)
    model_type: str = "cohere_compass"
    image_token_id: int = 255031
    video_token_id: int = 255032
    vision_start_token_id: int = 255028
    vision_end_token_id: int = 255029
    # The top-level key (None: absent); after __post_init__, how Model builds the head, which
    # head_tied() re-decides from the weights (Model.sanitize). declared_*: the key as written.
    tie_word_embeddings: Optional[bool] = None
    declared_tie_word_embeddings: Optional[bool] = field(default=None, repr=False)
    eos_token_id: Any = None
    pad_token_id: Optional[int] = None

    @classmethod
    def from_dict(cls, params: Dict[str, Any]) -> "ModelConfig":
        params = dict(params or {})
        if params.get("model_type", "cohere_compass") != "cohere_compass":
            raise ValueError(
                f"config.json has model_type {params.get('model_type')!r}; this package "
                "only runs 'cohere_compass' checkpoints"
            )
        for key, klass in (
            ("text_config", TextConfig),
            ("vision_config", VisionConfig),
        ):
            sub = params.get(key)
            if sub is None or isinstance(sub, dict):
                params[key] = klass.from_dict(sub or {})
        return cls(**_known_fields(cls, params))

    def __post_init__(self):
        if self.eos_token_id is None:
            self.eos_token_id = self.text_config.eos_token_id
        if self.declared_tie_word_embeddings is None:
            self.declared_tie_word_embeddings = self.tie_word_embeddings
        declared = self.declared_tie_word_embeddings
        self.tie_word_embeddings = bool(
            self.text_config.tie_word_embeddings if declared is None else declared
        )

    def head_tied(
        self, lm_head_stored: bool, same_as_embedding: bool = False
    ) -> Optional[bool]:
        """Whether the output head is the token embedding, as transformers 5.24 loads the checkpoint
        (tests/test_tie_head.py): a stored ``lm_head`` is used (tied only when the top-level key is
        true and it equals the embedding); none stored ties when the top-level key is true; where
        the reference would run a random head, text_config's key ties if true, else None."""
        if lm_head_stored:
            return bool(self.declared_tie_word_embeddings and same_as_embedding)
        if self.declared_tie_word_embeddings:
            return True
        return True if self.text_config.tie_word_embeddings else None

    def to_dict(self) -> Dict[str, Any]:
        return {
            k: v
            for k, v in self.__dict__.items()
            if v is not None and k != "declared_tie_word_embeddings"
        }


# Original (CohereLabs) prefixes -> this module tree's (the MLX conversions'); no mlx import here.
WEIGHT_LAYOUT = (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "vision_tower."),
    ("lm_head.", "language_model.lm_head."),
)


def weight_key(key: str, tied: bool) -> Optional[str]:
    """A stored weight's name in this module tree (either layout), or None for a tensor the model
    drops (``position_ids`` buffers; ``lm_head`` when tied). Idempotent."""
    if key.rsplit(".", 1)[-1] == "position_ids":
        return None
    for src, dst in WEIGHT_LAYOUT:
        if key.startswith(src):
            key = key.replace(src, dst, 1)
            break
    if tied and key.startswith("language_model.lm_head."):
        return None
    return key


def grid_sequence(grid_thw: Sequence[Sequence[int]]):
    """Yield ``(t, h, w)`` int tuples from an ``image_grid_thw``-like array or list."""
    for row in grid_thw.tolist() if hasattr(grid_thw, "tolist") else grid_thw:
        t, h, w = (int(v) for v in row)
        yield t, h, w
