"""Torch-free processor for cohere_compass: tokenizer (one BOS), chat template, prompt expansion.

transformers' ``CohereCompassProcessor`` is the reference; how each mlx-vlm pin drives a processor
and where this departs from the reference: docs/processor.md.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
from transformers.feature_extraction_utils import BatchFeature

from .image_processing_cohere_compass import (
    IMAGE_PROCESSOR_KEYS,
    PIXEL_BOUND_KEYS,
    CohereCompassImageProcessor,
    batch_feature,
    flatten_images,
    read_json,
    read_pixel_bounds,
)
from .video_processing_cohere_compass import (
    DEFAULT_FALLBACK_FPS,
    INSTANCE_ONLY_KEYS,
    NO_FPS_TIMESTAMP_WARNING,
    VIDEO_PROCESSOR_KEYS,
    CohereCompassVideoProcessor,
    VideoInputError,
    batched_videos,
    timestamps,
    warn_video_settings,
)

logger = logging.getLogger(__name__)

_TOKENIZER_CALL_KEYS = (
    "truncation",
    "max_length",
    "pad_to_multiple_of",
    "return_attention_mask",
    "return_token_type_ids",
    "return_length",
    "verbose",
)


def _named_templates(template):
    # tokenizer_config.json may hold [{"name": ..., "template": ...}, ...].
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}
    if isinstance(template, dict) and set(template) == {"default"}:
        return template["default"]
    return template


def load_chat_template(path: Path, tokenizer=None):
    """Chat template of a checkpoint folder, newest layout first."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    for name in (
        "chat_template.json",
        "processor_config.json",
        "tokenizer_config.json",
    ):
        template = (read_json(path / name) or {}).get("chat_template")
        if template:
            return _named_templates(template)
    return getattr(tokenizer, "chat_template", None)


VIDEO_TOKEN = "<|VIDEO_PAD|>"


def _count_video_tokens(text) -> int:
    texts = [text] if isinstance(text, str) else text
    if not isinstance(texts, (list, tuple)):
        return 0
    return sum(t.count(VIDEO_TOKEN) for t in texts if isinstance(t, str))


def _media(conversation) -> tuple:
    """(images, videos) of user messages' list content, by the template's rules (None: a part
    without its image or frames)."""
    images, videos = [], []
    for message in conversation:
        content = message.get("content")
        if message.get("role") != "user" or not isinstance(content, list):
            continue
        for part in (p for p in content if isinstance(p, dict)):
            if part.get("type") == "image" or "image" in part or "image_url" in part:
                images.append(_image_source(part))
            elif part.get("type") == "video" or "video" in part:
                keys = [k for k in ("video", "url", "path") if part.get(k) is not None]
                videos.append(part[keys[0]] if keys else None)
    return images, videos


def _image_source(part: dict):
    for key in ("image", "image_url", "path", "url"):
        value = part.get(key)
        if isinstance(value, dict):  # OpenAI style: {"image_url": {"url": ...}}
            value = value.get("url")
        if value is not None:
            return value
    return None


def _video_call_defaults(values: dict) -> dict:
    """The video settings among ``values`` that transformers applies to every call (the
    instance-only ones, which it drops at call time, excepted)."""
    return {
        k: v
        for k, v in values.items()
        if k in VIDEO_PROCESSOR_KEYS and k not in INSTANCE_ONLY_KEYS and v is not None
    }


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(path), trust_remote_code=False, local_files_only=True
    )
    return without_double_bos(tokenizer)


def without_double_bos(tokenizer):
    """Make ``tokenizer`` skip its own BOS when the text already starts with it (the chat template
    writes one) and refuse text holding the video token (no video can come with it); its class is
    swapped for a subclass, so every holder gets it (``_compass_encode_expanded``: no video check)."""
    base = type(tokenizer)
    if getattr(base, "_compass_no_double_bos", False) or not tokenizer.bos_token:
        return tokenizer

    def adds_bos(self) -> bool:
        if "_compass_adds_bos" not in self.__dict__:
            ids = base.__call__(self, "", add_special_tokens=True)["input_ids"]
            self.__dict__["_compass_adds_bos"] = list(ids[:1]) == [self.bos_token_id]
        return self.__dict__["_compass_adds_bos"]

    def strip(self, text, add_special_tokens):
        bos = self.bos_token
        if not add_special_tokens or not bos or not adds_bos(self):
            return text
        if isinstance(text, str):
            return text[len(bos) :] if text.startswith(bos) else text
        if isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text):
            return [t[len(bos) :] if t.startswith(bos) else t for t in text]
        return text

    def guarded(method, refuse_video: bool = True):
        def call(self, text=None, *args, add_special_tokens=True, **kwargs):
            found = _count_video_tokens(text) if refuse_video else 0
            if found:
                raise VideoInputError(
                    f"cohere_compass: the text holds {found} {VIDEO_TOKEN} token(s) (a video part of a message "
                    "renders as one) but no video was passed with it. Pass the frames through the processor, "
                    "processor(text=..., videos=[frames], video_metadata=[{'total_num_frames': ..., 'fps': ...}]), "
                    "or drop the video part."
                )
            text = strip(self, text, add_special_tokens)
            return method(
                self, text, *args, add_special_tokens=add_special_tokens, **kwargs
            )

        return call

    tokenizer.__class__ = _subclass(
        base,
        __call__=guarded(base.__call__),
        encode=guarded(base.encode),
        _compass_encode_expanded=guarded(base.__call__, refuse_video=False),
        _compass_no_double_bos=True,
    )
    return tokenizer


def _subclass(base: type, **attrs) -> type:
    """A subclass of ``base`` under its own name, with ``attrs``."""
    return type(
        base.__name__,
        (base,),
        {**attrs, "__module__": base.__module__, "__qualname__": base.__qualname__},
    )


@functools.lru_cache(maxsize=None)
def _skipping_class(base: type) -> type:
    def add_token(self, token, *args, **kwargs):
        if int(token) >= self._compass_vocab_size:
            return None
        return base.add_token(self, token, *args, **kwargs)

    return _subclass(
        base,
        add_token=add_token,
        _compass_skips_padding_ids=True,
        _compass_original_class=base,
    )


def skipping_padding_ids(detokenizer, vocab_size: int):
    """``detokenizer`` ignoring ids >= ``vocab_size``, as transformers' ``decode`` does; its class is
    swapped for a subclass, so ``copy()`` keeps the guard."""
    if detokenizer is None or getattr(detokenizer, "_compass_skips_padding_ids", False):
        return detokenizer
    detokenizer._compass_vocab_size = int(vocab_size)
    detokenizer.__class__ = _skipping_class(type(detokenizer))
    return detokenizer


class CohereCompassProcessor:
    """Tokenizer + image and video processors for cohere_compass; expands each
    ``<|IMAGE_PAD|>`` into its image's tokens and each ``<|VIDEO_PAD|>`` into its video's
    timestamped blocks."""

    image_token = "<|IMAGE_PAD|>"
    video_token = "<|VIDEO_PAD|>"
    vision_start_token = "<|VISION_START|>"
    vision_end_token = "<|VISION_END|>"

    def __init__(
        self,
        image_processor=None,
        tokenizer=None,
        chat_template=None,
        image_defaults=None,
        video_processor=None,
        video_defaults=None,
        **kwargs,
    ):
        if tokenizer is None:
            raise ValueError("CohereCompassProcessor needs a tokenizer")
        # The image and video kwargs every call starts from (level 2 of the pixel bounds): from_pretrained
        # passes them; otherwise the tokenizer's init kwargs hold them, as in transformers' ProcessorMixin.
        init_kwargs = getattr(tokenizer, "init_kwargs", None) or {}
        if image_defaults is None:
            image_defaults = {
                k: init_kwargs[k]
                for k in PIXEL_BOUND_KEYS
                if init_kwargs.get(k) is not None
            }
        self.image_defaults = dict(image_defaults)
        if video_defaults is None:
            video_defaults = _video_call_defaults(init_kwargs)
        self.video_defaults = dict(video_defaults)
        self.image_processor = image_processor or CohereCompassImageProcessor()
        self.video_processor = video_processor or CohereCompassVideoProcessor()
        self.tokenizer = without_double_bos(tokenizer)
        self.chat_template = (
            chat_template
            if chat_template is not None
            else getattr(tokenizer, "chat_template", None)
        )
        self.image_token_id = self._token_id(self.image_token, required=True)
        self.video_token_id = self._token_id(self.video_token)
        self.vision_start_token_id = self._token_id(self.vision_start_token)
        self.vision_end_token_id = self._token_id(self.vision_end_token)

    def _token_id(self, token: str, required: bool = False) -> Optional[int]:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            if required:
                raise ValueError(f"the tokenizer has no {token} token")
            return None
        return token_id

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """Build from a local checkpoint folder; loader options (revision, use_fast,
        trust_remote_code, ...) are ignored: nothing here reaches the network or runs
        checkpoint code. Image and video processor keys in ``kwargs`` override the folder's
        values (a key both take, such as ``size``, goes to both, as in transformers)."""
        path = Path(pretrained_model_name_or_path)
        if not path.is_dir():
            raise OSError(
                f"{path} is not a local checkpoint folder (download it first)"
            )
        video_overrides = {k: kwargs[k] for k in VIDEO_PROCESSOR_KEYS if k in kwargs}
        overrides = {k: kwargs[k] for k in IMAGE_PROCESSOR_KEYS if k in kwargs}
        tokenizer = _load_tokenizer(path)
        bounds = read_pixel_bounds(path, load_kwargs=overrides)
        image_processor = CohereCompassImageProcessor.from_dict(
            bounds.image_config, **overrides
        )
        # What a call without kwargs uses, so num_image_tokens agrees.
        image_processor = image_processor.with_settings(bounds.call_defaults)
        video_processor = CohereCompassVideoProcessor.from_pretrained(
            path, **video_overrides
        )
        # transformers hands from_pretrained kwargs to the tokenizer too, so they are call defaults as well.
        video_defaults = {
            **_video_call_defaults(read_json(path / "tokenizer_config.json") or {}),
            **_video_call_defaults(video_overrides),
        }
        chat_template = kwargs.get("chat_template") or load_chat_template(
            path, tokenizer
        )
        if getattr(tokenizer, "chat_template", None) is None:
            tokenizer.chat_template = chat_template  # for callers templating through it
        return cls(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=chat_template,
            image_defaults=bounds.call_defaults,
            video_processor=video_processor,
            video_defaults=video_defaults,
        )

    def save_pretrained(self, save_directory, **kwargs):
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(str(path))
        self.image_processor.save_pretrained(str(path))
        # Its own file: the image processor's file may carry image bounds the video must not take.
        self.video_processor.save_pretrained(str(path))
        if isinstance(self.chat_template, str):
            (path / "chat_template.jinja").write_text(
                self.chat_template, encoding="utf-8"
            )
        return [str(path)]

    model_input_names = [
        "input_ids",
        "attention_mask",
        "mm_token_type_ids",
        *CohereCompassImageProcessor.model_input_names,
        *CohereCompassVideoProcessor.model_input_names,
    ]

    def __call__(
        self,
        images=None,
        text=None,
        videos=None,
        *,
        video_metadata=None,
        fps=None,
        num_frames=None,
        do_sample_frames: Optional[bool] = None,
        padding=False,
        padding_side: Optional[str] = None,
        add_special_tokens: bool = True,
        return_tensors=None,
        return_mm_token_type_ids: bool = True,
        return_metadata: bool = False,
        **kwargs,
    ) -> BatchFeature:
        """transformers' call: ``text`` with one ``<|IMAGE_PAD|>`` per image and one ``<|VIDEO_PAD|>``
        per video. Videos are frames, sampled from their ``video_metadata`` by ``fps`` (a number:
        frames per second to take; a list, one per video: the rate of frames already sampled) or
        ``num_frames``; image and video settings may be passed as keywords."""
        if text is None and images is None and videos is None:
            raise ValueError(
                "CohereCompassProcessor needs text, images, videos or a mix"
            )
        call = {
            "fps": fps,
            "num_frames": num_frames,
            "do_sample_frames": do_sample_frames,
        }
        given = {k: v for k, v in {**kwargs, **call}.items() if v is not None}
        image_kwargs = {
            **self.image_defaults,
            **{k: v for k, v in given.items() if k in IMAGE_PROCESSOR_KEYS},
        }
        video_kwargs = {
            **self.video_defaults,
            **{k: v for k, v in given.items() if k in VIDEO_PROCESSOR_KEYS},
        }
        if "num_frames" in video_kwargs and fps is None:
            video_kwargs.pop("fps", None)  # num_frames beats an fps default
        tokenizer_kwargs = {
            k: v for k, v in kwargs.items() if k in _TOKENIZER_CALL_KEYS
        }
        known = {*IMAGE_PROCESSOR_KEYS, *VIDEO_PROCESSOR_KEYS, *_TOKENIZER_CALL_KEYS}
        if set(kwargs) - known:
            logger.warning(
                "CohereCompassProcessor ignores unsupported argument(s): %s",
                sorted(set(kwargs) - known),
            )

        images = flatten_images(images) if images is not None else []
        videos = batched_videos(videos)
        texts = None
        if text is not None:
            texts = [text] if isinstance(text, str) else list(text)
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("`text` must be a string or a list of strings")
            placeholders = sum(t.count(self.image_token) for t in texts)
            if placeholders != len(images):
                raise ValueError(
                    f"the text has {placeholders} {self.image_token} placeholder(s) but {len(images)} "
                    "image(s) were passed; they must match"
                )
            video_placeholders = sum(t.count(self.video_token) for t in texts)
            if video_placeholders != len(videos):
                raise VideoInputError(
                    f"the text has {video_placeholders} {self.video_token} placeholder(s) (one per video part of a "
                    f"message) but {len(videos)} video(s) were passed; pass one video per placeholder"
                )

        image_inputs, counts = {}, []
        if images:
            image_inputs = dict(self.image_processor(images, **image_kwargs))
            merge = image_kwargs.get("merge_size") or self.image_processor.merge_size
            counts = [
                int(np.prod(g)) // merge**2
                for g in np.asarray(image_inputs["image_grid_thw"])
            ]

        video_inputs, blocks, video_token_count, settled = {}, [], 0, []
        if videos:
            video_inputs, settled = self.video_processor.run_batched(
                videos, video_metadata, **video_kwargs
            )
            blocks, video_token_count = self._video_blocks(
                video_inputs["video_grid_thw"], settled, video_kwargs
            )

        data = {}
        if texts is not None:
            texts = self._expand(texts, counts, blocks)
            if padding_side is not None:
                tokenizer_kwargs["padding_side"] = padding_side
            tokenizer_kwargs.setdefault("return_token_type_ids", False)
            encode = getattr(self.tokenizer, "_compass_encode_expanded", self.tokenizer)
            encoded = encode(
                texts,
                padding=padding,
                add_special_tokens=add_special_tokens,
                **tokenizer_kwargs,
            )
            data.update(encoded)
            type_ids = [self._token_types(row) for row in encoded["input_ids"]]
            for kind, code, expected in (
                ("image", 1, sum(counts)),
                ("video", 2, video_token_count),
            ):
                found = sum(int(np.sum(np.asarray(r) == code)) for r in type_ids)
                if found != expected:
                    raise ValueError(
                        f"tokenized text holds {found} {kind} tokens, expected {expected} (was it truncated?)"
                    )
            if return_mm_token_type_ids:
                data["mm_token_type_ids"] = type_ids
        data.update(image_inputs)
        data.update(video_inputs)
        out = batch_feature(data, return_tensors)
        if return_metadata and videos:
            out["video_metadata"] = [s._asdict() for s in settled]
        return out

    def _video_blocks(self, grids, settled, video_kwargs) -> tuple:
        """Each video's replacement text and the number of video tokens in all of them."""
        vp = self.video_processor
        merge = video_kwargs.get("merge_size") or vp.merge_size
        temporal = video_kwargs.get("temporal_patch_size") or vp.temporal_patch_size
        blocks, total = [], 0
        for grid, sampled in zip(np.asarray(grids), settled):
            per_patch = int(grid[1] * grid[2]) // merge**2
            rate = sampled.fps
            if rate is None:
                warn_video_settings(NO_FPS_TIMESTAMP_WARNING)
                rate = DEFAULT_FALLBACK_FPS
            seconds = timestamps(sampled.frames_indices, rate, temporal)
            block = (
                self.vision_start_token
                + self.video_token * per_patch
                + self.vision_end_token
            )
            blocks.append(
                "".join(f"<{t:.1f} seconds>" + block for t in seconds[: int(grid[0])])
            )
            total += per_patch * int(grid[0])
        return blocks, total

    def _expand(
        self, texts: List[str], counts: List[int], blocks: Sequence[str] = ()
    ) -> List[str]:
        """Each placeholder, in order across the batch, becomes its image's tokens or its video's blocks."""
        images, videos = iter(counts), iter(blocks)
        pattern = re.compile(
            re.escape(self.image_token) + "|" + re.escape(self.video_token)
        )

        def replace(match):
            if match.group(0) == self.image_token:
                return self.image_token * next(images)
            return next(videos)

        return [pattern.sub(replace, t) for t in texts]

    def _token_types(self, ids) -> List[int]:
        ids = np.asarray(ids)
        types = np.zeros(ids.shape, dtype=np.int64)
        types[ids == self.image_token_id] = 1
        if self.video_token_id is not None:
            types[ids == self.video_token_id] = 2
        return types.tolist()

    def apply_chat_template(
        self, conversation, chat_template=None, tokenize: bool = False, **kwargs
    ):
        """Render with this processor's template through the tokenizer. With ``tokenize=True``
        the text goes through this processor, with the images and videos found in the messages
        (a video part's ``video`` / ``url`` / ``path``: decoded frames; paths are not decoded
        here) and the processor keywords in ``kwargs`` (``video_metadata``, ``fps``, ...)."""
        template = chat_template if chat_template is not None else self.chat_template
        batch = bool(conversation) and not isinstance(conversation[0], dict)
        call_keys = {"video_metadata", *VIDEO_PROCESSOR_KEYS, *IMAGE_PROCESSOR_KEYS}
        processor_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in call_keys}
        if not tokenize:
            return self.tokenizer.apply_chat_template(
                conversation, chat_template=template, tokenize=False, **kwargs
            )
        if batch:
            raise ValueError(
                "tokenize=True takes one conversation (a list of messages), not a batch"
            )
        return_dict = kwargs.pop("return_dict", False)
        return_tensors = kwargs.pop("return_tensors", None)
        text = self.tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False, **kwargs
        )
        images, videos = _media(conversation)
        if any(image is None for image in images):
            raise ValueError(
                "an image part carries no image; render with tokenize=False and call the processor"
            )
        if any(v is None for v in videos):
            raise VideoInputError(
                "a video part carries no frames; put them in its 'video' key, or render with tokenize=False and "
                "call the processor with videos=[...]"
            )
        out = self(
            text=text,
            images=images or None,
            videos=videos or None,
            add_special_tokens=False,
            return_tensors=return_tensors,
            **processor_kwargs,
        )
        return out if return_dict else out["input_ids"]

    # compass-compat: the detokenizer mlx-vlm assigns skips ids past the tokenizer (padded vocabulary).
    @property
    def detokenizer(self):
        if "_detokenizer" not in self.__dict__:  # unset, as before the property existed
            raise AttributeError(
                "CohereCompassProcessor has no detokenizer (mlx-vlm's load_processor sets one)"
            )
        return self.__dict__["_detokenizer"]

    @detokenizer.setter
    def detokenizer(self, detokenizer):
        self.__dict__["_detokenizer"] = skipping_padding_ids(
            detokenizer, len(self.tokenizer)
        )

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)
