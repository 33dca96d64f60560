"""The torch-free video processor against transformers' own (recorded in tests/fixtures/video).

transformers' ``CohereCompassVideoProcessor`` needs torchvision, so its outputs were recorded
by ``scripts/reference/video_processor.py`` (.venvs/reference-video) on clips that
``compass_data.clips.make_clip`` draws again here (their sha256 is checked first). Per case:
ids, ``mm_token_type_ids`` and grids exact; ``pixel_values_videos`` within 1e-5 where the
reference keeps the frames' size, within one uint8 level (2/255 after mean = std = 0.5) where it
resizes them, with the share of values that differ recorded as junit properties; the
reference's warnings (no fps, no per-frame cap) given too. Then the ways mlx-vlm hands frames
over (0.7.x: ``sample_frames_in_loader`` and pre-sampled frames with metadata; 0.6.x: frames
and their rate, no metadata), and the named errors for bad input.

The processor modules are loaded by path (no mlx, no shim), as tests/test_processor.py does, so
this runs in every pass of the matrix.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import re
import warnings
from pathlib import Path
from typing import List, Optional

import numpy as np
import pytest
from PIL import Image

from compass_data.clips import make_clip
from compass_data.tiny import build_tiny_checkpoint
from tests.support import video_processor as recorder  # inputs of the cases, never expected values
from tests.support.recorded import VIDEO_PROCESSOR_INDEX, video_processor_case
from tests.support.vendored import by_path

pc = by_path("processing_cohere_compass", "compass_video_under_test")
vpc = by_path("video_processing_cohere_compass", "compass_video_under_test")

INDEX = VIDEO_PROCESSOR_INDEX
CASES = [name for name, case in INDEX["cases"].items() if case["kind"] == "processor"]
ONE_LEVEL = 2 / 255  # one uint8 level after (x/255 - 0.5) / 0.5
WARNING_NAMES = {
    "no_fps_sampling": vpc.NO_FPS_SAMPLING_WARNING,
    "no_fps_timestamps": vpc.NO_FPS_TIMESTAMP_WARNING,
    "uncapped": vpc.UNCAPPED_WARNING,
}
VIDEO_PART = "<|VISION_START|><|VIDEO_PAD|><|VISION_END|>"


expected = video_processor_case  # the recorded arrays of a case


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Checkpoint folder per settings variant: the tiny checkpoint plus the variant's files."""
    out = {}
    for variant in recorder.VARIANTS:
        folder = build_tiny_checkpoint(tmp_path_factory.mktemp(f"video_{variant}"), layout="original")
        recorder.write_variant(folder, variant)
        out[variant] = folder
    return out


@pytest.fixture(scope="module")
def processors(folders):
    cache = {}

    def get(variant: str = "default", load: Optional[dict] = None):
        key = json.dumps([variant, load or {}], sort_keys=True)
        if key not in cache:
            cache[key] = pc.CohereCompassProcessor.from_pretrained(folders[variant], **(load or {}))
        return cache[key]

    return get


@functools.lru_cache(maxsize=None)
def clip(*spec: int) -> np.ndarray:
    frames = make_clip(*spec)
    frames.flags.writeable = False
    return frames


def case_frames(name: str) -> List[np.ndarray]:
    return [clip(*spec) for spec in INDEX["cases"][name]["clips"]]


def case_images(name: str):
    spec = INDEX["cases"][name]["image"]
    return [make_clip(1, *spec)[0]] if spec else None


def run(processor, name: str, videos=None, **overrides):
    """Our processor on the case's rendered prompt; returns (outputs, names of the warnings given)."""
    case = INDEX["cases"][name]
    kwargs = dict(case["ours"] if case["ours"] is not None else case["call"])
    kwargs.update(overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = processor(
            text=[case["prompt"]],
            videos=case_frames(name) if videos is None else videos,
            images=case_images(name),
            add_special_tokens=False,
            return_tensors="np",
            **kwargs,
        )
    given = {str(w.message) for w in caught if issubclass(w.category, vpc.VideoSettingsWarning)}
    return out, sorted(key for key, text in WARNING_NAMES.items() if text in given)


def assert_pixels(got: np.ndarray, want: np.ndarray, resized: bool, record_property=None, prefix="video") -> None:
    assert got.dtype == np.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    if record_property is not None:
        record_property(f"{prefix}_pixel_values", int(diff.size))
        record_property(f"{prefix}_pixel_values_differing", int(np.count_nonzero(diff > 1e-5)))
        record_property(f"{prefix}_pixel_max_abs_diff", float(diff.max()))
    limit = ONE_LEVEL + 1e-6 if resized else 1e-5
    assert diff.max() <= limit, f"max |diff| {diff.max():.3g} > {limit:.3g} (resized: {resized})"


def test_clips_are_the_recorded_ones():
    """The frames drawn here are the frames the reference saw."""
    for key, digest in INDEX["clips"].items():
        assert hashlib.sha256(clip(*map(int, key.split("x"))).tobytes()).hexdigest() == digest, key
    for key, digest in INDEX["stills"].items():
        assert hashlib.sha256(make_clip(1, *map(int, key.split("x")))[0].tobytes()).hexdigest() == digest, key


@pytest.mark.parametrize("name", CASES)
def test_case_matches_the_reference(processors, name, record_property):
    case = INDEX["cases"][name]
    want = expected(name)
    out, given_warnings = run(processors(case["variant"], case["load"]), name)
    np.testing.assert_array_equal(np.asarray(out["input_ids"]), want["input_ids"])
    np.testing.assert_array_equal(np.asarray(out["mm_token_type_ids"]), want["mm_token_type_ids"])
    np.testing.assert_array_equal(out["video_grid_thw"], want["video_grid_thw"])
    assert_pixels(out["pixel_values_videos"], want["pixel_values_videos"], any(case["resized"]), record_property)
    if "image_grid_thw" in want:
        np.testing.assert_array_equal(out["image_grid_thw"], want["image_grid_thw"])
        assert_pixels(out["pixel_values"], want["pixel_values"], False, prefix="image")
    assert given_warnings == case["warnings"]


@pytest.mark.parametrize(
    "name,form",
    [(n, f) for n in CASES for f in INDEX["cases"][n]["equivalent_inputs_checked"] if f in ("pil", "channels_first")],
)
def test_other_frame_containers_give_the_same(processors, name, form):
    """PIL frames and (T, 3, H, W) arrays (mlx-vlm's load_video) give the recorded outputs, as
    they give the reference's (checked when recording)."""
    frames = case_frames(name)
    videos = (
        [[Image.fromarray(f) for f in v] for v in frames]
        if form == "pil"
        else [np.ascontiguousarray(v.transpose(0, 3, 1, 2)) for v in frames]
    )
    out, _ = run(processors(), name, videos=videos)
    np.testing.assert_array_equal(np.asarray(out["input_ids"]), expected(name)["input_ids"])
    np.testing.assert_array_equal(out["pixel_values_videos"], run(processors(), name)[0]["pixel_values_videos"])


@pytest.mark.parametrize(
    "name", [n for n in CASES if "apply_chat_template" in INDEX["cases"][n]["equivalent_inputs_checked"]]
)
def test_apply_chat_template_takes_video_parts(processors, name):
    case = INDEX["cases"][name]
    messages = json.loads(json.dumps(case["messages"]))
    frames, images = iter(case_frames(name)), iter(case_images(name) or [])
    for message in messages:
        for part in message["content"]:
            if part["type"] == "video":
                part["video"] = next(frames)
            elif part["type"] == "image":
                part["image"] = next(images)
    processor = processors(case["variant"], case["load"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vpc.VideoSettingsWarning)
        out = processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="np", **case["call"]
        )
    np.testing.assert_array_equal(np.asarray(out["input_ids"]), expected(name)["input_ids"])
    np.testing.assert_array_equal(out["video_grid_thw"], expected(name)["video_grid_thw"])
    # Rendering alone keeps the template's one video part per video.
    text = processor.apply_chat_template(case["messages"], add_generation_prompt=True)
    assert text == case["prompt"] and text.count(VIDEO_PART) == len(case["clips"])


SAMPLED = [
    n
    for n in CASES
    if INDEX["cases"][n]["call"].get("do_sample_frames", True) and INDEX["cases"][n]["call"].get("video_metadata")
]


@pytest.mark.parametrize("name", SAMPLED)
def test_sample_frames_gives_the_reference_indices(processors, name):
    case = INDEX["cases"][name]
    processor = processors(case["variant"], case["load"])
    call = case["ours"] if case["ours"] is not None else case["call"]
    # The rate a call falls back to: tokenizer_config.json's (a call default), else the instance's.
    settings = {**processor.video_defaults, **call}
    for metadata, indices in zip(call["video_metadata"], case["frames_indices"]):
        kwargs = {k: settings[k] for k in ("fps", "num_frames") if settings.get(k) is not None}
        got = processor.video_processor.sample_frames(dict(metadata), **kwargs)
        assert got.tolist() == indices


# ---------------------------------------------------------------- departures, documented


def test_call_time_max_frames_applies(processors):
    """The reference reads max_frames from the instance only (load_max_frames_6 was recorded
    with from_pretrained(max_frames=6)); a call's max_frames gives the same here."""
    out, _ = run(processors(), "load_max_frames_6", max_frames=6)
    np.testing.assert_array_equal(np.asarray(out["input_ids"]), expected("load_max_frames_6")["input_ids"])


def test_call_time_max_video_tokens_applies(processors):
    """Likewise max_video_tokens (large_frames_capped_100_tokens: from_pretrained(max_video_tokens=100))."""
    out, _ = run(processors(), "large_frames_capped_100_tokens", max_video_tokens=100)
    np.testing.assert_array_equal(out["video_grid_thw"], expected("large_frames_capped_100_tokens")["video_grid_thw"])
    np.testing.assert_array_equal(np.asarray(out["input_ids"]), expected("large_frames_capped_100_tokens")["input_ids"])


def test_num_frames_alone_samples(processors):
    """The reference needs fps=None with num_frames (its default fps counts as given); both
    calls give its output here."""
    call = dict(INDEX["cases"]["num_frames_7"]["call"])
    for kwargs in (call, {k: v for k, v in call.items() if k != "fps"}):
        out, _ = run(processors(), "num_frames_7", **kwargs)
        np.testing.assert_array_equal(np.asarray(out["input_ids"]), expected("num_frames_7")["input_ids"])
    with pytest.raises(ValueError, match="mutually exclusive"):
        run(processors(), "num_frames_7", num_frames=7, fps=2)


def test_unresized_single_frame_is_padded_as_the_reference_pads_it():
    """With do_resize=False the reference never resizes, so never counts frames: one frame is
    repeated to a whole temporal patch, as two copies of it give."""
    frame = make_clip(1, 64, 64, 3)
    vp = vpc.CohereCompassVideoProcessor(do_resize=False, cap_pixels_per_frame=False)
    one = vp(frame, do_sample_frames=False)
    np.testing.assert_array_equal(one["video_grid_thw"], [[1, 4, 4]])
    two = vp(np.concatenate([frame, frame]), do_sample_frames=False)
    np.testing.assert_array_equal(one["pixel_values_videos"], two["pixel_values_videos"])


# ---------------------------------------------------------------- mlx-vlm's ways in


def mlx_vlm_metadata_class():
    """mlx-vlm 0.7.x's VideoMetadata, or a stand-in with its fields on pins that lack it."""
    try:
        from mlx_vlm.utils import VideoMetadata

        return VideoMetadata
    except ImportError:

        @dataclasses.dataclass
        class VideoMetadata:
            total_num_frames: int
            fps: float
            frames_indices: list
            width: Optional[int] = None
            height: Optional[int] = None
            duration: Optional[float] = None

            @property
            def sampled_fps(self) -> float:
                return len(self.frames_indices) / max(self.total_num_frames, 1e-6) * self.fps

        return VideoMetadata


def test_processor_handles_video_and_declares_sampling(processors):
    processor = processors()
    assert processor.video_processor is not None and "videos" in inspect.signature(processor).parameters
    # mlx-vlm's process_inputs forwards only keywords the call names.
    assert {"videos", "fps", "video_metadata"} <= set(inspect.signature(processor).parameters)
    vp = processor.video_processor
    assert vp.sample_frames_in_loader is True
    assert (vp.fps, vp.min_frames, vp.max_frames) == (2, 4, 768)
    try:
        from mlx_vlm.generate.video import processor_handles_video
    except ImportError:
        return  # mlx-vlm < 0.6 has no native video path
    assert processor_handles_video(processor)


def test_loader_contract_0_7(processors, record_property):
    """mlx-vlm 0.7.x: indices from sample_frames on the source metadata, the frames at those
    indices as (T, C, H, W), fps=[sampled fps], metadata with the source's count, rate and the
    indices: the reference's ids for the whole clip, not sampled again."""
    case = INDEX["cases"]["loader_contract"]
    processor = processors()
    VideoMetadata = mlx_vlm_metadata_class()
    source = case_frames("loader_contract")[0]
    total, rate = case["call"]["video_metadata"][0]["total_num_frames"], case["call"]["video_metadata"][0]["fps"]
    whole = VideoMetadata(total_num_frames=total, fps=rate, frames_indices=list(range(total)))
    vp = processor.video_processor
    indices = np.asarray(vp.sample_frames(whole, fps=vp.fps, max_frames=vp.max_frames), dtype=int).reshape(-1)
    assert indices.tolist() == case["frames_indices"][0]
    metadata = VideoMetadata(total_num_frames=total, fps=rate, frames_indices=indices.tolist())
    frames = np.ascontiguousarray(source[indices].transpose(0, 3, 1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vpc.VideoSettingsWarning)
        out = processor(
            text=[case["prompt"]],
            images=None,
            videos=[frames],
            fps=[metadata.sampled_fps],
            video_metadata=[metadata],
            padding=True,
            add_special_tokens=False,
            return_tensors="np",
        )
    np.testing.assert_array_equal(np.asarray(out["input_ids"]), expected("loader_contract")["input_ids"])
    assert_pixels(out["pixel_values_videos"], expected("loader_contract")["pixel_values_videos"], True, record_property)


def mlx_vlm_0_6_sampling(total: int, video_fps: float, fps: float = 2.0) -> tuple:
    """mlx-vlm 0.6.x load_video's rule (utils.py): n frames, rounded down to even, and the rate it reports."""
    import math

    lo = math.ceil(4 / 2) * 2
    hi = math.floor(min(768, total) / 2) * 2
    n = math.floor(min(max(total / video_fps * fps, lo), hi, total) / 2) * 2
    return np.linspace(0, total - 1, n).round().astype(int), n / total * video_fps


def test_frames_and_rate_without_metadata_0_6(processors, record_property):
    """mlx-vlm 0.6.x passes the frames it sampled and fps=[their rate], no metadata: accepted,
    not sampled again, frame i at i / rate. The frames here are the reference's (same count and
    indices for this clip), so the grid and pixels are its; the timestamps are not, since frames
    spread over the whole clip are not i / rate apart (recorded as properties)."""
    case = INDEX["cases"]["loader_contract"]
    source = case_frames("loader_contract")[0]
    meta0 = case["call"]["video_metadata"][0]
    indices, rate = mlx_vlm_0_6_sampling(meta0["total_num_frames"], meta0["fps"])
    assert indices.tolist() == case["frames_indices"][0]  # the same frames as the reference
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vpc.VideoSettingsWarning)
        out = processors()(
            text=[case["prompt"]],
            videos=[np.ascontiguousarray(source[indices].transpose(0, 3, 1, 2))],
            fps=[rate],
            add_special_tokens=False,
            return_tensors="np",
        )
    np.testing.assert_array_equal(out["video_grid_thw"], expected("loader_contract")["video_grid_thw"])
    assert_pixels(out["pixel_values_videos"], expected("loader_contract")["pixel_values_videos"], True)
    text = processors().tokenizer.decode(np.asarray(out["input_ids"])[0].tolist())
    ours = re.findall(r"<(\d+\.\d) seconds>", text)
    n = len(indices)
    assert ours == [f"{(i / rate + (i + 1) / rate) / 2:.1f}" for i in range(0, n, 2)]
    record_property("timestamps_mlx_vlm_0_6_call", " ".join(ours))
    record_property("timestamps_reference", " ".join(case["timestamps"]))
    assert ours != case["timestamps"]  # the documented difference; the CLI passes metadata instead


def write_lossless_clip(path: Path, clip: np.ndarray, fps: float) -> Path:
    cv2 = pytest.importorskip("cv2", reason="writing a video file needs OpenCV (mlx-vlm reads videos with it)")
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"FFV1"), fps, (clip.shape[2], clip.shape[1]))
    if not writer.isOpened():
        pytest.skip("this OpenCV cannot write FFV1 (lossless) video")
    for frame in clip:
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    return path


def test_mlx_vlm_prepare_inputs_with_a_file(processors, tmp_path):
    """The pin's own prepare_inputs decoding a lossless file of the clip: on 0.7.x (the loader
    asks sample_frames) the reference's ids and pixels; on 0.6.x its own sampling and rate."""
    utils = pytest.importorskip("mlx_vlm.utils")
    if not hasattr(utils, "load_video"):
        pytest.skip("this mlx-vlm reads no video files (load_video arrived in 0.6); runs on 0.6.12 and 0.7.10")
    case = INDEX["cases"]["loader_contract"]
    meta0 = case["call"]["video_metadata"][0]
    source = case_frames("loader_contract")[0]
    path = write_lossless_clip(tmp_path / "clip.avi", source, float(meta0["fps"]))
    processor = processors()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vpc.VideoSettingsWarning)
        inputs = utils.prepare_inputs(processor, videos=[str(path)], prompts=[case["prompt"]], add_special_tokens=False)
    ids = np.asarray(inputs["input_ids"])
    if "frame_sampler" in inspect.signature(utils.load_video).parameters:  # 0.7.x
        np.testing.assert_array_equal(ids, expected("loader_contract")["input_ids"])
        np.testing.assert_array_equal(
            np.asarray(inputs["pixel_values_videos"]), expected("loader_contract")["pixel_values_videos"]
        )
    else:  # 0.6.x: the rate mlx-vlm reports, frame i at i / rate
        _, rate = mlx_vlm_0_6_sampling(meta0["total_num_frames"], meta0["fps"])
        text = processor.tokenizer.decode(ids[0].tolist())
        n = int(np.asarray(inputs["video_grid_thw"])[0, 0]) * 2
        assert re.findall(r"<(\d+\.\d) seconds>", text) == [
            f"{(i / rate + (i + 1) / rate) / 2:.1f}" for i in range(0, n, 2)
        ]
        np.testing.assert_array_equal(
            np.asarray(inputs["video_grid_thw"]), expected("loader_contract")["video_grid_thw"]
        )


# ---------------------------------------------------------------- bad input: named errors


@pytest.fixture(scope="module")
def video_call(processors):
    processor = processors()

    def call(videos, text=None, **kwargs):
        text = text if text is not None else "<BOS_TOKEN>Look: " + VIDEO_PART
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", vpc.VideoSettingsWarning)
            return processor(text=text, videos=videos, add_special_tokens=False, **kwargs)

    return call


GOOD = make_clip(4, 64, 64, 1)


@pytest.mark.parametrize(
    "videos,text,match",
    [
        ([GOOD, GOOD], None, "1 <|VIDEO_PAD|> placeholder(s) .* but 2 video"),
        ([GOOD], "<BOS_TOKEN>" + VIDEO_PART * 2, "2 <|VIDEO_PAD|> .* but 1 video"),
        (None, "<BOS_TOKEN>" + VIDEO_PART, "but 0 video"),
        ([GOOD[:0]], None, "no frames"),
        ([[]], None, "no frames"),
        ([[GOOD[0], make_clip(1, 32, 64, 2)[0]]], None, "same size"),
        (
            [[Image.fromarray(GOOD[0]), Image.fromarray(make_clip(1, 32, 64, 2)[0])]],
            None,
            "same size",
        ),
        ([GOOD.astype(np.float32)], None, "uint8"),
        ([GOOD.astype(np.float32) / 255], None, "uint8"),
        (["clip.mp4"], None, "Decode the file first"),
        (GOOD[0], None, "at least 2 frames"),  # one frame, as transformers reads it
        (np.zeros((32, 32), np.uint8), None, "frames, height, width, 3"),
        ([np.zeros((4, 32, 32, 4), np.uint8)], None, "convert the frames to RGB"),
        ([[Image.fromarray(f).convert("L") for f in GOOD]], None, "convert\\('RGB'\\)"),
        ([{"frames": GOOD}], None, "pass a uint8 array"),
        ([GOOD[:1]], None, "at least 2 frames"),
    ],
    ids=[
        "more-videos-than-tokens",
        "more-tokens-than-videos",
        "tokens-without-videos",
        "zero-frames-array",
        "zero-frames-list",
        "frames-of-different-sizes",
        "pil-frames-of-different-sizes",
        "float-frames",
        "float-frames-0-1",
        "a-path",
        "a-3d-array",
        "a-2d-array",
        "rgba-array",
        "grey-pil-frames",
        "a-dict",
        "one-frame",
    ],
)
def test_bad_video_input_gets_a_named_error(video_call, videos, text, match):
    with pytest.raises(vpc.VideoInputError, match=match) as err:
        video_call(videos, text=text, do_sample_frames=False)
    assert isinstance(err.value, ValueError) and pc.VideoInputError is vpc.VideoInputError


def test_metadata_that_does_not_fit_the_frames_is_refused(video_call):
    clip = make_clip(8, 64, 64, 1)
    with pytest.raises(vpc.VideoInputError, match="total_num_frames=90 but 8 frames"):
        video_call([clip], video_metadata=[{"total_num_frames": 90, "fps": 30}])
    with pytest.raises(vpc.VideoInputError, match="has 3 entries"):
        video_call(
            [clip],
            video_metadata=[{"total_num_frames": 8, "fps": 30, "frames_indices": [0, 1, 2]}],
            do_sample_frames=False,
        )
    with pytest.raises(vpc.VideoInputError, match="2 video_metadata entries .* 1 videos"):
        video_call([clip], video_metadata=[{"total_num_frames": 8, "fps": 30}] * 2)
    with pytest.raises(vpc.VideoInputError, match="2 fps values .* 1 videos"):
        video_call([clip], fps=[2.0, 2.0])


def test_video_token_through_the_tokenizer_alone_is_refused(processors):
    """mlx-vlm tokenizes text-only prompts itself: a video part's token there has no frames."""
    tokenizer = processors().tokenizer
    for call in (lambda: tokenizer("<BOS_TOKEN>" + VIDEO_PART), lambda: tokenizer.encode(VIDEO_PART)):
        with pytest.raises(pc.VideoInputError, match="no video was passed"):
            call()
