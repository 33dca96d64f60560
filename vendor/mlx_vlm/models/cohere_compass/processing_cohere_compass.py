"""Torch-free processor for cohere_compass (North-Micro-Vision): tokenizer loading, prompt
expansion, video refusal and ``CohereCompassProcessor``.

Behaviour follows transformers' ``CohereCompassProcessor`` (5.21+); the image processor is
in ``image_processing_cohere_compass.py`` (its public names are re-exported here), and the
module imports on transformers 4.57 and 5.x alike. Importing it registers nothing:
compass_compat registers ``CohereCompassProcessor`` with ``AutoProcessor``.

How the mlx-vlm pins drive a processor (read from their utils.py / prompt_utils.py /
generate code):

- Loading, every pin: ``load_processor`` calls ``AutoProcessor.from_pretrained(path,
  **load_kwargs)`` (0.4.4 adds ``use_fast=True``), then sets ``processor.detokenizer``
  and ``processor.tokenizer.stopping_criteria``. ``load`` swaps in
  ``processor.image_processor`` only when the model package exports ``ImageProcessor``
  (this one must not). ``convert`` calls ``processor.save_pretrained``.
- Prompt: 0.3.9 uses ``processor.apply_chat_template(messages, tokenize=False,
  add_generation_prompt=...)`` only if ``"chat_template" in processor.__dict__``; 0.4.4+
  when ``processor.chat_template`` is not None, else the tokenizer's. 0.6.12+ add
  ``enable_thinking=False`` when the method takes ``**kwargs``.
- Text-only prompts never reach the processor: every pin calls
  ``processor.tokenizer(prompts, add_special_tokens=True, ...)`` itself.
- With images: mlx-vlm's llava path runs when ``image_processor`` is an instance of
  *mlx-vlm's own* ``BaseImageProcessor``; ours derives from transformers' class, so the
  processor is called as ``processor(text=..., images=[PIL...], padding=True,
  return_tensors="mlx", add_special_tokens=True)`` (True on every pin for this model
  type). 0.4.4+ add ``padding_side="left"`` if the signature names it; 0.7.10 also
  forwards ``min_pixels``/``max_pixels``/``resized_height``/``resized_width`` when the
  caller set them and the signature has ``**kwargs``. 0.3.9 retries with
  ``return_tensors="pt"`` after any exception. Every returned key becomes a model
  keyword argument. 0.4.4+ convert images to RGB (alpha dropped) before the call.
- 0.7.10 reads ``image_processor.num_image_tokens(h, w, **overrides)`` for budgets.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
from transformers.feature_extraction_utils import BatchFeature

from .image_processing_cohere_compass import (
    DEFAULT_MERGE_SIZE,
    GRID_MEMO,
    IMAGE_PROCESSOR_KEYS,
    PIXEL_BOUND_KEYS,
    CohereCompassImageProcessor,
    PixelBounds,
    batch_feature,
    convert_and_resize,
    flatten_images,
    image_processor_settings,
    read_json,
    read_pixel_bounds,
    resolve_pixel_bounds,
    smart_resize,
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
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        template = (read_json(path / name) or {}).get("chat_template")
        if template:
            return _named_templates(template)
    return getattr(tokenizer, "chat_template", None)


# ---------------------------------------------------------------- video: refused
#
# The published template renders a video part as <|VISION_START|><|VIDEO_PAD|><|VISION_END|>,
# but this processor has no video preprocessing (frames, timestamps, video grids). Rendering
# the token and running the model anyway would fail deep in the model or, worse, answer
# without the video; so every way in refuses it first: a ``videos=`` argument, a video part
# in apply_chat_template's messages, and any text holding the token (processor call and the
# tokenizer, which mlx-vlm calls itself for text-only prompts).

VIDEO_TOKEN = "<|VIDEO_PAD|>"


class VideoNotSupportedError(ValueError):
    """Video input reached the cohere_compass processor, which supports images only."""


def video_refusal(what: str) -> VideoNotSupportedError:
    return VideoNotSupportedError(
        f"cohere_compass (compass-compat): video input is not supported: {what}. "
        f"The chat template writes {VIDEO_TOKEN} for a video part of a user message "
        "({'type': 'video'} or a 'video' key). Send the video as still frames instead: one "
        "image part per frame in the message, with the frames passed as images."
    )


def refuse_video_text(text) -> None:
    """Raise :class:`VideoNotSupportedError` if ``text`` (a string or a list of them) holds the token."""
    texts = [text] if isinstance(text, str) else text if isinstance(text, (list, tuple)) else ()
    if any(isinstance(t, str) and VIDEO_TOKEN in t for t in texts):
        raise video_refusal(f"the prompt contains {VIDEO_TOKEN}, the token of a video part in a message")


def _is_image_part(part: dict) -> bool:  # the template's rule for user messages
    return part.get("type") == "image" or "image" in part or "image_url" in part


def _is_video_part(part: dict) -> bool:
    return part.get("type") == "video" or "video" in part


def _user_parts(conversation):
    """(message index, part index, part) of the dict parts of user messages' list content."""
    for i, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        if message.get("role") != "user" or not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict):
                yield i, j, part


def _image_source(part: dict):
    for key in ("image", "image_url", "path", "url"):
        value = part.get(key)
        if isinstance(value, dict):  # OpenAI style: {"image_url": {"url": ...}}
            value = value.get("url")
        if value is not None:
            return value
    return None


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        # transformers 4.57 cannot resolve a tokenizer from an unknown model_type; the
        # tokenizer.json alone is enough.
        if not (path / "tokenizer.json").is_file():
            raise
        logger.warning("AutoTokenizer failed for %s (%s); loading tokenizer.json directly", path, err)
        extra = (read_json(path / "tokenizer_config.json") or {}).get("extra_special_tokens")
        # transformers 5 saves extra_special_tokens as a list (e.g. mlx-vlm 0.7.10's converter
        # output); 4.57 expects a dict of named tokens: pass the list as additional_special_tokens.
        legacy = {"extra_special_tokens": {}, "additional_special_tokens": extra} if isinstance(extra, list) else {}
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True, **legacy)
    return without_double_bos(tokenizer)


def without_double_bos(tokenizer):
    """Make ``tokenizer`` skip its own BOS when the text already starts with it.

    Every mlx-vlm pin tokenizes text-only chat prompts with ``add_special_tokens=True``
    straight through ``processor.tokenizer`` (and image prompts through the processor,
    which calls it the same way), while the chat template already wrote ``{{ bos_token }}``;
    a Cohere-style BOS post-processor would then give two BOS tokens. This is the only
    double-BOS guard. The instance's class is swapped for a subclass (same state, same
    name) so every caller of this tokenizer gets the fix, not only this processor. The subclass also
    refuses text holding the video token (:func:`refuse_video_text`): mlx-vlm tokenizes
    text-only prompts itself, so this processor's ``__call__`` never sees them.
    """
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

    def __call__(self, text=None, *args, add_special_tokens=True, **kwargs):
        refuse_video_text(text)
        return base.__call__(
            self, strip(self, text, add_special_tokens), *args, add_special_tokens=add_special_tokens, **kwargs
        )

    def encode(self, text, *args, add_special_tokens=True, **kwargs):
        refuse_video_text(text)
        return base.encode(
            self, strip(self, text, add_special_tokens), *args, add_special_tokens=add_special_tokens, **kwargs
        )

    guarded = type(
        base.__name__,
        (base,),
        {
            "__call__": __call__,
            "encode": encode,
            "_compass_no_double_bos": True,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
        },
    )
    tokenizer.__class__ = guarded
    return tokenizer


_GUARDED_DETOKENIZERS: Dict[type, type] = {}


def skipping_padding_ids(detokenizer, vocab_size: int):
    """``detokenizer`` with an ``add_token`` that ignores ids >= ``vocab_size``, as
    transformers' ``decode`` does; everything else (reset, finalize, text, last_segment,
    tokens, tokenmap, copy(), isinstance checks of mlx-vlm's server) is the object's own.

    The instance's class is swapped for a subclass, as in :func:`without_double_bos`, so
    ``copy()`` (mlx-vlm >= 0.6 servers copy it per request) keeps the guard.
    """
    if detokenizer is None or getattr(detokenizer, "_compass_skips_padding_ids", False):
        return detokenizer
    base = type(detokenizer)
    guarded = _GUARDED_DETOKENIZERS.get(base)
    if guarded is None:

        def add_token(self, token, *args, **kwargs):
            if int(token) >= self._compass_vocab_size:
                return None
            return base.add_token(self, token, *args, **kwargs)

        guarded = _GUARDED_DETOKENIZERS[base] = type(
            base.__name__,
            (base,),
            {
                "add_token": add_token,
                "_compass_skips_padding_ids": True,
                "_compass_original_class": base,
                "__module__": base.__module__,
                "__qualname__": base.__qualname__,
            },
        )
    try:
        detokenizer._compass_vocab_size = int(vocab_size)
        detokenizer.__class__ = guarded
    except (TypeError, AttributeError) as err:  # a C type or __slots__: cannot carry the guard
        logger.warning(
            "cohere_compass: cannot guard %s against ids past the tokenizer (%s); sampling such an id may fail in it",
            base.__name__,
            err,
        )
    return detokenizer


class CohereCompassProcessor:
    """Tokenizer + image processor for cohere_compass; expands each ``<|IMAGE_PAD|>``."""

    image_token = "<|IMAGE_PAD|>"
    video_token = "<|VIDEO_PAD|>"
    vision_start_token = "<|VISION_START|>"
    vision_end_token = "<|VISION_END|>"

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, image_defaults=None, **kwargs):
        if tokenizer is None:
            raise ValueError("CohereCompassProcessor needs a tokenizer")
        # Level 2 of "pixel bounds" (image_processing_cohere_compass.py): image kwargs every
        # call starts from. from_pretrained passes them (read from the folder's files);
        # otherwise the tokenizer's init kwargs hold them, as transformers' ProcessorMixin does.
        if image_defaults is None:
            init_kwargs = getattr(tokenizer, "init_kwargs", None) or {}
            image_defaults = {k: init_kwargs[k] for k in PIXEL_BOUND_KEYS if init_kwargs.get(k) is not None}
        self.image_defaults = dict(image_defaults)
        self.image_processor = image_processor if image_processor is not None else CohereCompassImageProcessor()
        # The one double-BOS guard is the tokenizer's own (from_pretrained's has it already).
        self.tokenizer = without_double_bos(tokenizer)
        # An instance attribute: mlx-vlm 0.3.9 looks for it in __dict__.
        self.chat_template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
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
        checkpoint code. Image processor keys in ``kwargs`` override the folder's values."""
        path = Path(pretrained_model_name_or_path)
        if not path.is_dir():
            raise OSError(f"{path} is not a local checkpoint folder (download it first)")
        overrides = {k: kwargs.pop(k) for k in IMAGE_PROCESSOR_KEYS if k in kwargs}
        tokenizer = _load_tokenizer(path)
        bounds = read_pixel_bounds(path, load_kwargs=overrides)
        image_processor = CohereCompassImageProcessor.from_dict(bounds.image_config, **overrides)
        if bounds.call_defaults:  # what a call without kwargs uses, so num_image_tokens agrees
            image_processor = image_processor._with_overrides(bounds.call_defaults)
        chat_template = kwargs.pop("chat_template", None) or load_chat_template(path, tokenizer)
        if getattr(tokenizer, "chat_template", None) is None and chat_template is not None:
            tokenizer.chat_template = chat_template  # for callers that template via the tokenizer
        return cls(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=chat_template,
            image_defaults=bounds.call_defaults,
        )

    def save_pretrained(self, save_directory, **kwargs):
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(str(path))
        self.image_processor.save_pretrained(str(path))
        if isinstance(self.chat_template, str):
            (path / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        return [str(path)]

    @property
    def model_input_names(self) -> List[str]:
        return ["input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"]

    def __call__(
        self,
        images=None,
        text=None,
        videos=None,
        *,
        padding=False,
        padding_side: Optional[str] = None,
        add_special_tokens: bool = True,
        return_tensors=None,
        return_mm_token_type_ids: bool = True,
        **kwargs,
    ) -> BatchFeature:
        if videos is not None:
            raise video_refusal("a `videos=` argument was passed")
        refuse_video_text(text)
        if text is None and images is None:
            raise ValueError("CohereCompassProcessor needs text, images or both")
        image_kwargs = {k: kwargs.pop(k) for k in IMAGE_PROCESSOR_KEYS if k in kwargs}
        # Call kwargs over the tokenizer-level defaults (level 2 of "pixel bounds").
        image_kwargs = {**self.image_defaults, **{k: v for k, v in image_kwargs.items() if v is not None}}
        tokenizer_kwargs = {k: kwargs.pop(k) for k in _TOKENIZER_CALL_KEYS if k in kwargs}
        if kwargs:
            logger.warning("CohereCompassProcessor ignores unsupported argument(s): %s", sorted(kwargs))

        images = flatten_images(images) if images is not None else []
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

        image_inputs = {}
        if images:
            image_processor = self.image_processor
            image_inputs = dict(image_processor(images, **image_kwargs))
            merge = image_kwargs.get("merge_size") or getattr(image_processor, "merge_size", DEFAULT_MERGE_SIZE)
            counts = [int(np.prod(g)) // merge**2 for g in np.asarray(image_inputs["image_grid_thw"])]
            texts = self._expand(texts, counts) if texts is not None else None

        data = {}
        if texts is not None:
            if padding_side is not None:
                tokenizer_kwargs["padding_side"] = padding_side
            tokenizer_kwargs.setdefault("return_token_type_ids", False)
            encoded = self.tokenizer(texts, padding=padding, add_special_tokens=add_special_tokens, **tokenizer_kwargs)
            data.update(encoded)
            type_ids = [self._token_types(row) for row in encoded["input_ids"]]
            if images:
                found = sum(int(np.sum(np.asarray(r) == 1)) for r in type_ids)
                if found != sum(counts):
                    raise ValueError(
                        f"tokenized text holds {found} image tokens, expected {sum(counts)} (was it truncated?)"
                    )
            if return_mm_token_type_ids:
                data["mm_token_type_ids"] = type_ids
        data.update(image_inputs)
        return batch_feature(data, return_tensors)

    def _expand(self, texts: List[str], counts: List[int]) -> List[str]:
        """Each placeholder, in order across the batch, becomes its image's token count."""
        remaining = iter(counts)
        expanded = []
        for t in texts:
            pieces = t.split(self.image_token)
            out = [pieces[0]]
            for piece in pieces[1:]:
                out.append(self.image_token * next(remaining))
                out.append(piece)
            expanded.append("".join(out))
        return expanded

    def _token_types(self, ids) -> List[int]:
        ids = np.asarray(ids)
        types = np.zeros(ids.shape, dtype=np.int64)
        types[ids == self.image_token_id] = 1
        if self.video_token_id is not None:
            types[ids == self.video_token_id] = 2
        return types.tolist()

    def apply_chat_template(self, conversation, chat_template=None, tokenize: bool = False, **kwargs):
        """Render with this processor's template through the tokenizer. With ``tokenize=True``
        the text goes through this processor, with the images found in the messages.
        A video part (or the video token in the text) raises :class:`VideoNotSupportedError`."""
        template = chat_template if chat_template is not None else self.chat_template
        batch = bool(conversation) and not isinstance(conversation[0], dict)
        for i, j, part in (p for c in (conversation if batch else [conversation]) for p in _user_parts(c)):
            if not _is_image_part(part) and _is_video_part(part):
                raise video_refusal(f"message {i} has a video part (content[{j}])")
        if not tokenize:
            text = self.tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False, **kwargs)
            refuse_video_text(text)  # e.g. the token typed into a text part
            return text
        if batch:
            raise ValueError("tokenize=True takes one conversation (a list of messages), not a batch")
        return_dict = kwargs.pop("return_dict", False)
        return_tensors = kwargs.pop("return_tensors", None)
        text = self.tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False, **kwargs)
        # The parts the template renders as an image: user messages only, as it decides.
        images = [_image_source(part) for _, _, part in _user_parts(conversation) if _is_image_part(part)]
        if None in images:
            raise ValueError("an image part carries no image; render with tokenize=False and call the processor")
        out = self(text=text, images=images or None, add_special_tokens=False, return_tensors=return_tensors)
        return out if return_dict else out["input_ids"]

    # compass-compat: ids past the tokenizer (the published checkpoint has 255035 tokenizer
    # entries but 262144 embedding rows) can be sampled; transformers decodes them to "",
    # while mlx-vlm's BPEStreamingDetokenizer raises IndexError. mlx-vlm's load_processor
    # assigns ``processor.detokenizer``: the setter makes that object skip such ids.
    @property
    def detokenizer(self):
        if "_detokenizer" not in self.__dict__:  # unset, as before the property existed
            raise AttributeError("CohereCompassProcessor has no detokenizer (mlx-vlm's load_processor sets one)")
        return self.__dict__["_detokenizer"]

    @detokenizer.setter
    def detokenizer(self, detokenizer):
        self.__dict__["_detokenizer"] = skipping_padding_ids(detokenizer, len(self.tokenizer))

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(image_processor={type(self.image_processor).__name__}, "
            f"tokenizer={type(self.tokenizer).__name__}, image_token_id={self.image_token_id})"
        )


# The image-processing names are re-exported: hosts, compass_compat and the tests import them from here.
__all__ = [
    "GRID_MEMO",
    "CohereCompassImageProcessor",
    "CohereCompassProcessor",
    "PixelBounds",
    "VideoNotSupportedError",
    "convert_and_resize",
    "flatten_images",
    "image_processor_settings",
    "read_pixel_bounds",
    "resolve_pixel_bounds",
    "smart_resize",
]
