"""Torch-free video processor for cohere_compass.

transformers' ``CohereCompassVideoProcessor`` is the reference; where this departs from it:
docs/processor.md.
"""

from __future__ import annotations

import json
import math
import numbers
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

from .image_processing_cohere_compass import (
    SHARED_KEYS,
    Settings,
    batch_feature,
    patchify,
    positive_int,
    smart_resize,
)
from .uint8_resize import resize_frames

# transformers' CohereCompassVideoProcessor class defaults (used for keys the settings file lacks).
DEFAULT_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}
DEFAULT_FALLBACK_FPS = 24  # the reference's assumption when metadata carries no fps
BICUBIC = 3  # PIL's id, as the settings files store it

VIDEO_PROCESSOR_KEYS = (
    *SHARED_KEYS,
    "min_frames",
    "max_frames",
    "do_sample_frames",
    "fps",
    "num_frames",
    "cap_pixels_per_frame",
    "max_video_tokens",
    "return_metadata",
)

# transformers reads these from the instance only, so tokenizer_config.json's copies never apply.
INSTANCE_ONLY_KEYS = ("min_frames", "max_frames", "max_video_tokens")


class VideoInputError(ValueError):
    """A video input the processor cannot use; the message says what to pass instead."""


class VideoSettingsWarning(UserWarning):
    """The reference's warnings: no fps in the metadata, no per-frame pixel cap chosen."""


NO_FPS_SAMPLING_WARNING = (
    "Asked to sample `fps` frames per second but no video metadata was provided which is required when sampling "
    "with `fps`. Defaulting to `fps=24`. Please provide `video_metadata` for more accurate results."
)
NO_FPS_TIMESTAMP_WARNING = (
    "CohereCompass requires frame timestamps to construct prompts, but the `fps` of the input video could not be "
    "inferred. Probably `video_metadata` was missing from inputs and you passed pre-sampled frames. Defaulting to "
    "`fps=24`. Please provide `video_metadata` for more accurate results."
)
UNCAPPED_WARNING = (
    "CohereCompass video processing does not apply the per-frame pixel cap the reference implementation "
    "(qwen-vl-utils) applies, so some videos cost far more tokens than they would there. Pass "
    "`cap_pixels_per_frame=True` to adopt the capped behavior, or `False` to keep the uncapped behavior and "
    "silence this warning."
)


def warn_video_settings(message: str) -> None:
    """One of the reference's warnings; Python's default filter shows each once per call site."""
    warnings.warn(message, VideoSettingsWarning, stacklevel=2)


class _Frames:
    """One video's frames, checked without copying; :meth:`take` returns (T, 3, H, W) uint8."""

    def __init__(self, video: Any, position: int):
        self.position = position
        if isinstance(video, (str, bytes, Path)):
            raise VideoInputError(
                f"video {position} is a path or URL ({str(video)[:80]!r}); this processor takes decoded frames. "
                "Decode the file first (e.g. mlx_vlm.utils.load_video) and pass the frames with their metadata."
            )
        is_list = isinstance(video, (list, tuple))
        self.frames = list(video) if is_list else _as_array(video, position)
        if not is_list:
            if self.frames.ndim != 4:
                raise VideoInputError(
                    f"video {position} is an array of shape {self.frames.shape}; pass (frames, height, width, 3) or "
                    "(frames, 3, height, width) uint8, or a list of RGB PIL images"
                )
            _check_dtype(self.frames.dtype, position)
        if not len(self.frames):
            raise VideoInputError(f"video {position} has no frames; pass at least 2")
        shape = self._checked_list() if is_list else self.frames.shape[1:]
        # The reference's rule: channels first when the first axis could be channels (in a list, if
        # the last one cannot).
        self.channels_first = shape[0] == 3 and not (is_list and shape[-1] == 3)
        if not self.channels_first and shape[-1] != 3:
            raise VideoInputError(
                f"video {position} has frames of shape {shape}: neither the first nor the last axis has 3 (RGB) "
                "channels; convert the frames to RGB"
            )
        self.shape = shape

    def _checked_list(self) -> tuple:
        """The shape of one frame: RGB PIL images or (H, W, 3) uint8 arrays, all one size."""
        shape = None
        for i, frame in enumerate(self.frames):
            where = f"video {self.position}: frame {i}"
            if isinstance(frame, Image.Image):
                if frame.mode != "RGB":
                    raise VideoInputError(
                        f"{where} is a PIL image in mode {frame.mode!r}; convert the frames with frame.convert('RGB') first"
                    )
                this = (frame.height, frame.width, 3)
            else:
                self.frames[i] = frame = _as_array(frame, self.position)
                if frame.ndim != 3:
                    raise VideoInputError(
                        f"{where} has shape {frame.shape}; pass (height, width, 3) uint8 frames"
                    )
                _check_dtype(frame.dtype, self.position)
                this = frame.shape
            if shape is not None and this != shape:
                raise VideoInputError(
                    f"{where} has shape {this} but frame 0 has {shape}; every frame of a video must have the same size"
                )
            shape = this
        return shape

    def __len__(self) -> int:
        return len(self.frames)

    def size(self) -> Tuple[int, int]:
        return tuple(self.shape[1:]) if self.channels_first else tuple(self.shape[:2])

    def take(self, indices: Sequence[int]) -> np.ndarray:
        """The frames at ``indices`` (repeats allowed) as a (T, 3, H, W) uint8 array."""
        if isinstance(self.frames, np.ndarray):
            frames = self.frames[np.asarray(indices, dtype=np.intp)]
        else:
            frames = np.stack([np.asarray(self.frames[i]) for i in indices])
        return np.ascontiguousarray(
            frames if self.channels_first else frames.transpose(0, 3, 1, 2)
        )


def _as_array(value: Any, position: int) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if not hasattr(value, "__array__") and not hasattr(value, "shape"):
        raise VideoInputError(
            f"video {position} is a {type(value).__name__}; pass a uint8 array (frames, height, width, 3) or "
            "(frames, 3, height, width), or a list of RGB PIL images"
        )
    return np.asarray(value)


def _check_dtype(dtype, position: int) -> None:
    if dtype != np.uint8:
        raise VideoInputError(
            f"video {position} has frames of dtype {dtype}; pass uint8 frames (values 0-255), e.g. "
            "np.clip(frames * 255, 0, 255).astype(np.uint8) for floats in [0, 1]"
        )


def _field(metadata: Any, name: str):
    return (
        metadata.get(name)
        if isinstance(metadata, dict)
        else getattr(metadata, name, None)
    )


def _rate(name: str, value) -> Optional[float]:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not value > 0
        or not math.isfinite(value)
    ):
        error = VideoInputError if name.startswith("metadata") else ValueError
        raise error(
            f"cohere_compass video processor: `{name}` must be a positive number, got {value!r}"
        )
    return value


class SampledVideo(NamedTuple):
    """What sampling settled for one video."""

    # Which of the frames passed are used, in order (repeats allowed).
    positions: List[int]
    # Their positions in the source clip: timestamps are frames_indices / fps.
    frames_indices: List[int]
    # The source's frame rate; None: unknown (timestamps assume 24 and warn).
    fps: Optional[float]
    total_num_frames: int  # frames in the source clip


def timestamps(
    frames_indices: Sequence[int], fps: float, temporal_patch_size: int = 2
) -> List[float]:
    """Seconds of each temporal patch: the mean time of its first and last frame (indices
    padded by repeating the last, as the frames are), ``index / fps`` each."""
    indices = [int(i) for i in frames_indices]
    indices += indices[-1:] * (-len(indices) % temporal_patch_size)
    seconds = [i / fps for i in indices]
    return [
        (seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
        for i in range(0, len(seconds), temporal_patch_size)
    ]


class CohereCompassVideoProcessor(Settings):
    """Frames -> ``pixel_values_videos`` [N, 3*2*16*16] and ``video_grid_thw`` [videos, 3].

    Settings are the reference's (``VIDEO_PROCESSOR_KEYS``); a call may override any of them.
    ``sample_frames_in_loader`` tells mlx-vlm 0.7.x to choose frames with :meth:`sample_frames`
    while decoding a file and pass them with their metadata.
    """

    kind = "video"
    keys = VIDEO_PROCESSOR_KEYS
    model_input_names = ["pixel_values_videos", "video_grid_thw"]
    sample_frames_in_loader = True
    # Set by a host whose loader decodes files without naming the frames it took (mlx-vlm 0.6.x):
    # (frames, video processor, (min_frames, max_frames)) -> (frames, metadata) of that file, or None.
    reread_decoded: Optional[Callable[..., Optional[tuple]]] = None

    def __init__(
        self,
        size: Optional[Dict[str, int]] = None,
        resample: int = BICUBIC,
        do_resize: bool = True,
        do_rescale: bool = True,
        rescale_factor: float = 1 / 255,
        do_normalize: bool = True,
        image_mean: Sequence[float] = (0.5, 0.5, 0.5),
        image_std: Sequence[float] = (0.5, 0.5, 0.5),
        do_convert_rgb: bool = True,
        patch_size: int = 16,
        temporal_patch_size: int = 2,
        merge_size: int = 2,
        min_frames: int = 4,
        max_frames: int = 768,
        do_sample_frames: bool = True,
        fps: Optional[float] = 2,
        num_frames: Optional[int] = None,
        cap_pixels_per_frame: Optional[bool] = None,
        max_video_tokens: int = 768,
        return_metadata: bool = False,
        **kwargs,
    ):
        # Settings files carry other keys (class names, image-only keys): ignored, as the reference does.
        size = (
            {**DEFAULT_SIZE, **(dict(size) if isinstance(size, dict) else {})}
            if size is not None
            else DEFAULT_SIZE
        )
        merge_size = kwargs.pop("spatial_merge_size", merge_size)
        self._set_shared(locals())
        if int(resample) != BICUBIC:
            raise ValueError(
                f"cohere_compass video processor: only bicubic resampling (3) is implemented, got {resample!r}"
            )
        self.resample = BICUBIC
        self.min_frames = positive_int("min_frames", min_frames, "video")
        self.max_frames = positive_int("max_frames", max_frames, "video")
        self.do_sample_frames = bool(do_sample_frames)
        self.fps = _rate("fps", fps)
        self.num_frames = (
            None
            if num_frames is None
            else positive_int("num_frames", num_frames, "video")
        )
        self.cap_pixels_per_frame = (
            None if cap_pixels_per_frame is None else bool(cap_pixels_per_frame)
        )
        self.max_video_tokens = positive_int(
            "max_video_tokens", max_video_tokens, "video"
        )
        self.return_metadata = bool(return_metadata)

    @classmethod
    def from_dict(
        cls, settings: Dict[str, Any], **kwargs
    ) -> "CohereCompassVideoProcessor":
        """From a settings dict; ``kwargs`` that are settings override it (as transformers' from_dict)."""
        merged = {
            **dict(settings),
            **{k: v for k, v in kwargs.items() if k in VIDEO_PROCESSOR_KEYS},
        }
        return cls(
            **{
                k: v
                for k, v in merged.items()
                if k in VIDEO_PROCESSOR_KEYS or k == "spatial_merge_size"
            }
        )

    def to_dict(self) -> Dict[str, Any]:
        """The settings, as ``save_pretrained`` writes them."""
        out = {k: getattr(self, k) for k in VIDEO_PROCESSOR_KEYS}
        out["size"] = dict(self.size)
        out["video_processor_type"] = "CohereCompassVideoProcessor"
        return out

    def save_pretrained(self, save_directory) -> List[str]:
        """Write video_preprocessor_config.json; returns its path."""
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        target = path / "video_preprocessor_config.json"
        target.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return [str(target)]

    def sample_frames(
        self,
        metadata: Any,
        num_frames: Optional[int] = None,
        fps: Optional[float] = None,
        **kwargs,
    ) -> np.ndarray:
        """Indices of the frames the reference samples from a clip described by ``metadata``
        (``total_num_frames``, ``fps``); ``min_frames`` / ``max_frames`` in ``kwargs`` apply."""
        indices, _ = self._sample(
            metadata,
            num_frames,
            fps,
            kwargs.get("min_frames"),
            kwargs.get("max_frames"),
        )
        return indices

    def _sample(
        self, metadata, num_frames, fps, min_frames=None, max_frames=None
    ) -> Tuple[np.ndarray, Optional[float]]:
        """(indices, the source fps the timestamps use: the metadata's, 24 if it had none and fps
        sampling assumed it, None if unknown)."""
        if fps is not None and num_frames is not None:
            raise ValueError(
                "`num_frames` and `fps` are mutually exclusive arguments, please use only one!"
            )
        total = _field(metadata, "total_num_frames")
        if (
            isinstance(total, bool)
            or not isinstance(total, (int, np.integer))
            or total < 1
        ):
            raise VideoInputError(
                f"video metadata needs total_num_frames, a positive integer; got {total!r}"
            )
        total = int(total)
        source_fps = _rate("metadata fps", _field(metadata, "fps"))
        min_frames, max_frames = (
            getattr(self, name) if value is None else positive_int(name, value, "video")
            for name, value in (("min_frames", min_frames), ("max_frames", max_frames))
        )
        if num_frames is None and fps is None:
            num_frames = self.num_frames
            fps = self.fps if num_frames is None else None
        if num_frames is None and fps is not None:
            fps = _rate("fps", fps)
            if source_fps is None:
                warn_video_settings(NO_FPS_SAMPLING_WARNING)
                source_fps = DEFAULT_FALLBACK_FPS
            count = int(total / source_fps * fps)
            count = min(max(count, min_frames), max_frames, total)
        elif num_frames is None:
            count = min(max(total, min_frames), max_frames)
        else:
            count = positive_int("num_frames", num_frames, "video")
        return np.linspace(0, total - 1, count).round().astype(int), source_fps

    def _settle(
        self,
        video: "_Frames",
        metadata: Any,
        do_sample_frames: bool,
        fps,
        num_frames,
        limits,
    ) -> SampledVideo:
        """Which of ``video``'s frames to use, and where they sit in the source clip."""
        count = len(video)
        passed = list(range(count))
        if isinstance(fps, (list, tuple)) and metadata is None:
            # Frames a loader sampled itself, at this rate: never sampled again.
            return SampledVideo(
                passed, passed, _rate("fps", fps[video.position]), count
            )
        if metadata is None:
            metadata = {"total_num_frames": count}
        total = _field(metadata, "total_num_frames")
        given = _field(metadata, "frames_indices")
        source_fps = _rate("metadata fps", _field(metadata, "fps"))
        if given is not None and len(given) == count and total != count:
            # Pre-sampled (mlx-vlm 0.7.x's loader): the indices name source positions, not ours.
            return SampledVideo(passed, [int(i) for i in given], source_fps, total)
        if not do_sample_frames or isinstance(fps, (list, tuple)):
            # Frames as passed; a per-video fps list is their rate.
            if given is None:
                if total != count:
                    raise VideoInputError(
                        f"video {video.position}: the metadata says total_num_frames={total} but {count} frames were "
                        "passed and it has no frames_indices; pass frames_indices (the source position of each "
                        "frame) or all the frames"
                    )
                given = passed
            if len(given) != count:
                raise VideoInputError(
                    f"video {video.position}: {count} frames were passed but the metadata's frames_indices has "
                    f"{len(given)} entries; pass one index per frame"
                )
            return SampledVideo(passed, [int(i) for i in given], source_fps, total)
        indices, source_fps = self._sample(metadata, num_frames, fps, *limits)
        if indices.size and int(indices.max()) >= count:
            raise VideoInputError(
                f"video {video.position}: the metadata says total_num_frames={total} but {count} frames were passed; "
                "pass all the frames of the clip, or the sampled frames with their frames_indices (and "
                "total_num_frames of the source)"
            )
        indices = indices.tolist()
        return SampledVideo(indices, indices, source_fps, int(total))

    def resized_shape(
        self, num_frames: int, height: int, width: int
    ) -> Tuple[int, int]:
        """(height, width) the frames of a ``num_frames``-frame video are resized to."""
        factor = self.patch_size * self.merge_size
        if not self.do_resize:  # as the reference: frames padded, never resized
            if height % factor or width % factor:
                raise VideoInputError(
                    f"with do_resize=False the frame sides must be multiples of {factor}, got {width}x{height}"
                )
            return height, width
        if num_frames < self.temporal_patch_size:
            raise VideoInputError(
                f"a video needs at least {self.temporal_patch_size} frames (one temporal patch) after sampling, "
                f"got {num_frames}; pass more frames, or send a single frame as an image"
            )
        max_pixels = self.size["longest_edge"]
        if self.cap_pixels_per_frame:
            frame_cap = self.max_video_tokens * factor * factor
            per_frame = max(
                min(frame_cap, max_pixels // num_frames),
                int(self.size["shortest_edge"] * 1.05),
            )
            max_pixels = per_frame * num_frames
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        return smart_resize(
            height,
            width,
            factor,
            self.size["shortest_edge"],
            max_pixels,
            num_frames,
            self.temporal_patch_size,
            "video frame",
            VideoInputError,
        )

    def _normalized(self, frames: np.ndarray) -> np.ndarray:
        """uint8 (T, 3, H, W) -> float32, transformers' fused rescale + normalize, bit for bit."""
        x = frames.astype(np.float32)
        if not self.do_normalize:
            return x * np.float32(self.rescale_factor) if self.do_rescale else x
        # torch folds the rescale into float32 mean and std (times 1 / rescale_factor).
        scale = np.float32(1.0 / self.rescale_factor if self.do_rescale else 1.0)
        mean = np.asarray(self.image_mean, np.float32) * scale
        std = np.asarray(self.image_std, np.float32) * scale
        return (x - mean[:, None, None]) / std[:, None, None]

    def _process_video(
        self, video: "_Frames", sampled: SampledVideo
    ) -> Tuple[np.ndarray, List[int]]:
        """(patches, grid) of one video's sampled frames, padded to whole temporal patches."""
        height, width = video.size()
        target = self.resized_shape(len(sampled.positions), height, width)
        frames = video.take(sampled.positions)
        if self.do_resize:
            frames = resize_frames(frames, *target)
        pixels = self._normalized(frames)
        tp = self.temporal_patch_size
        if len(pixels) % tp:
            pixels = np.concatenate(
                [pixels, np.repeat(pixels[-1:], tp - len(pixels) % tp, axis=0)]
            )
        return patchify(pixels, self.patch_size, self.merge_size, tp)

    def preprocess(self, videos, video_metadata=None, return_tensors=None, **overrides):
        """Process ``videos`` (one video or a list); returns a ``BatchFeature`` with
        ``pixel_values_videos`` and ``video_grid_thw`` (and ``video_metadata`` if asked)."""
        data, settled = self.run_batched(
            batched_videos(videos), video_metadata, **overrides
        )
        out = batch_feature(data, return_tensors)
        if overrides.get("return_metadata", self.return_metadata):
            out["video_metadata"] = [s._asdict() for s in settled]
        return out

    __call__ = preprocess

    def run_batched(
        self, items: list, video_metadata=None, **overrides
    ) -> Tuple[Dict[str, np.ndarray], List[SampledVideo]]:
        """({pixel_values_videos, video_grid_thw}, what sampling settled for each video) of a list
        of videos (:func:`batched_videos`)."""
        fps = overrides.pop("fps", None)
        num_frames = overrides.pop("num_frames", None)
        do_sample = overrides.pop("do_sample_frames", None)
        limits = (overrides.pop("min_frames", None), overrides.pop("max_frames", None))
        overrides.pop("return_metadata", None)
        vp = self.with_settings(overrides)
        if vp.cap_pixels_per_frame is None:
            warn_video_settings(UNCAPPED_WARNING)
        do_sample = vp.do_sample_frames if do_sample is None else bool(do_sample)
        if isinstance(fps, (list, tuple)) and len(fps) != len(items):
            raise VideoInputError(
                f"{len(fps)} fps values were passed for {len(items)} videos; pass one per video"
            )
        metadata = batched_metadata(video_metadata, len(items))
        rows, grids, settled = [], [], []
        for position, (video, meta) in enumerate(zip(items, metadata)):
            rate_list = isinstance(fps, (list, tuple))
            if meta is None and rate_list and self.reread_decoded is not None:
                # Frames a loader decoded from a file: the reference's frames of that file.
                found = self.reread_decoded(video, vp, limits)
                if found is not None:
                    video, meta = found
            frames = _Frames(video, position)
            sampled = vp._settle(frames, meta, do_sample, fps, num_frames, limits)
            patches, grid = vp._process_video(frames, sampled)
            rows.append(patches)
            grids.append(grid)
            settled.append(sampled)
        data = {
            "pixel_values_videos": np.concatenate(rows, axis=0).astype(
                np.float32, copy=False
            ),
            "video_grid_thw": np.asarray(grids, dtype=np.int64),
        }
        return data, settled


def batched_videos(videos) -> list:
    """A list of videos from one video or a list of them, as transformers reads them: a 4-D
    array is a video, a 5-D one a batch, a list of PIL images or 3-D arrays one video of those
    frames, and a single PIL image or 3-D array a video of one frame."""
    if videos is None:
        return []
    if isinstance(videos, Image.Image):
        return [[videos]]
    if hasattr(videos, "shape") and not isinstance(videos, (list, tuple)):
        ndim = len(videos.shape)
        return list(videos) if ndim == 5 else [[videos]] if ndim == 3 else [videos]
    if isinstance(videos, (list, tuple)):
        if not videos:
            return []
        first = videos[0]
        if isinstance(first, Image.Image) or (
            hasattr(first, "shape") and len(first.shape) == 3
        ):
            return [list(videos)]
        return list(videos)
    return [videos]


def batched_metadata(video_metadata, count: int) -> list:
    """One metadata entry (or None) per video; a single dict or object is for a single video."""
    if video_metadata is None:
        return [None] * count
    if not isinstance(video_metadata, (list, tuple)):
        video_metadata = [video_metadata]
    if video_metadata and isinstance(video_metadata[0], (list, tuple)):
        video_metadata = [m for group in video_metadata for m in group]  # per prompt
    if len(video_metadata) != count:
        raise VideoInputError(
            f"{len(video_metadata)} video_metadata entries were passed for {count} videos; pass one per video"
        )
    return list(video_metadata)
