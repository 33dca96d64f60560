"""Reading video files for cohere_compass: the frames the reference's sampling picks, and their times,
decoded as the installed mlx-vlm decodes (its ``load_video`` where it takes a ``frame_sampler``, else
OpenCV with the same calls); :data:`DECODED_VIDEOS` re-reads files mlx-vlm 0.6.x decoded by its own rule.
"""

from __future__ import annotations

import inspect
import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from .errors import CompassCompatError

INSTALL_HINT = "pip install 'compass-compat[video]' (OpenCV; mlx-vlm itself normally brings opencv-python)"


class VideoDecoderMissingError(CompassCompatError):
    """OpenCV (``cv2``), the video decoder mlx-vlm uses, is not installed."""


class VideoFileError(ValueError):
    """A video file that cannot be read: corrupt, not a video, or without frames."""


@dataclass
class SourceMetadata:
    """What the decoder knows about a clip before sampling: the fields transformers'
    ``VideoMetadata`` has, which the video processor's ``sample_frames`` reads."""

    total_num_frames: int
    fps: Optional[float]
    frames_indices: List[int] = field(default_factory=list)


Sampler = Callable[[SourceMetadata], Sequence[int]]


def _cv2():
    try:
        import cv2
    except ImportError as err:
        raise VideoDecoderMissingError(f"reading video files needs OpenCV (cv2): {INSTALL_HINT}") from err
    return cv2


def probe(path: str) -> SourceMetadata:
    """Frame count and frame rate of a video file, as OpenCV reports them."""
    file = Path(_strip_scheme(path)).expanduser()
    cv2 = _cv2()
    cap = cv2.VideoCapture(str(file))
    try:
        if not cap.isOpened():
            raise VideoFileError(f"cannot open {file} as a video (corrupt, not a video, or a codec OpenCV lacks)")
        total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
    finally:
        cap.release()
    if total <= 0:
        raise VideoFileError(f"{file} reports no frames (corrupt or not a video)")
    fps_known = fps if fps > 0 and math.isfinite(fps) else None
    return SourceMetadata(total, fps_known, list(range(total)))


def read_video(path: str, sampler: Sampler) -> Tuple[np.ndarray, SourceMetadata]:
    """``(frames, metadata)`` of the frames ``sampler`` picks from ``path`` (``file://`` accepted):
    ``(T, H, W, 3)`` uint8 RGB, and the clip's metadata with ``frames_indices`` the indices read
    (``fps`` None where OpenCV cannot tell the rate: the processor assumes 24, as the reference)."""
    source = probe(path)
    indices = [int(i) for i in np.asarray(sampler(source)).reshape(-1)]
    frames = _decode(_strip_scheme(path), indices)
    if not frames:
        raise VideoFileError(f"no frame of {path} could be decoded (corrupt file?)")
    if len(frames) < len(indices):
        # As mlx-vlm: a read that fails part-way keeps the frames before it.
        indices = indices[: len(frames)]
    sizes = {f.shape for f in frames}
    if len(sizes) != 1:
        raise VideoFileError(f"{path} decoded to frames of different sizes {sorted(sizes)}")
    metadata = SourceMetadata(source.total_num_frames, source.fps, indices)
    return np.stack(frames), metadata


def _decode(path: str, indices: Sequence[int]) -> List[np.ndarray]:
    loader = _mlx_vlm_loader()
    if loader is not None:
        arr, _ = loader(path, frame_sampler=lambda *args, **kwargs: list(indices))
        return [np.ascontiguousarray(np.transpose(f, (1, 2, 0))) for f in arr]
    cv2 = _cv2()
    cap = cv2.VideoCapture(path)
    frames = []
    try:
        for index in indices:
            cap.set(cv2.CAP_PROP_POS_FRAMES, index)
            ok, frame = cap.read()
            if not ok:
                break
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    finally:
        cap.release()
    return frames


def _mlx_vlm_loader() -> Optional[Callable[..., Any]]:
    """``mlx_vlm.utils.load_video`` where it takes a ``frame_sampler`` (mlx-vlm 0.7.x), else None."""
    try:
        from mlx_vlm.utils import load_video  # mlx-vlm 0.4.x has none
    except ImportError:
        return None
    return load_video if "frame_sampler" in inspect.signature(load_video).parameters else None


def _strip_scheme(path: str) -> str:
    return path[len("file://") :] if str(path).startswith("file://") else str(path)


class DecodedVideos:
    """Clips mlx-vlm 0.6.x's ``load_video(path, fps=...)`` decoded without saying which frames it took,
    remembered weakly by identity with their file and rate, so the processor re-reads them by the reference's rule."""

    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self._entries: "OrderedDict[int, Tuple[Any, str, float]]" = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, frames: Any, path: str, fps: float) -> None:
        with self._lock:  # frames: the numpy array load_video returned
            self._entries[id(frames)] = (weakref.ref(frames), path, fps)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def reread(self, frames: Any, video_processor: Any, limits: Tuple[Any, Any]) -> Optional[Tuple[np.ndarray, Any]]:
        """(frames, metadata) of the file ``frames`` came from, sampled by ``video_processor``, or None."""
        with self._lock:
            entry = self._entries.get(id(frames))
        if entry is None or entry[0]() is not frames:
            return None
        _, path, fps = entry
        min_frames, max_frames = limits
        return read_video(
            path, lambda m: video_processor.sample_frames(m, fps=fps, min_frames=min_frames, max_frames=max_frames)
        )


DECODED_VIDEOS = DecodedVideos()
