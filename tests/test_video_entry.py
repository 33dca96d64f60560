"""Video entry points against the reference: a clip file read as the pin's mlx-vlm reads it, the
CLI's ``--video`` on every pin, mlx-vlm's own ``generate(video=)`` where the pin has one, and the
named errors for files that cannot be read.

The clips are written losslessly (FFV1 in AVI, which every pin's OpenCV writes and reads back
bit-exact), so the frames decoded here are the frames the reference sampled in
``scripts/reference/video_model.py`` (the toy checkpoint's ``file_*`` cases).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import pathlib

import numpy as np
import pytest

from compass_compat import cli
from compass_compat.video_files import VideoDecoderMissingError, VideoFileError, probe, read_video
from compass_data.clips import make_clip
from tests.support.recorded import VIDEO_INDEX, video_case
from tests.support.vendored import vendored

vendored()  # the toy's video answers are measured on our package; upstream 0.7.10 takes no video

REPO = pathlib.Path(__file__).resolve().parents[1]
FILE_CASES = {name: meta for name, meta in VIDEO_INDEX["checkpoints"]["toy"].items() if name.startswith("file_")}


def write_clip(path: pathlib.Path, frames: np.ndarray, fps: float) -> pathlib.Path:
    import cv2

    height, width = frames.shape[1:3]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"FFV1"), fps, (width, height))
    assert writer.isOpened(), "OpenCV cannot write FFV1"
    for frame in frames:
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    return path


@pytest.fixture(scope="module")
def toy_ckpt(tmp_path_factory):
    from compass_data.toy import build_toy_checkpoint

    return build_toy_checkpoint(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory):
    """clip name -> (file, frames): every clip the file cases use, written once."""
    folder = tmp_path_factory.mktemp("clips")
    out = {}
    for meta in FILE_CASES.values():
        video = meta["videos"][0]
        if video["clip"] in out:
            continue
        if "file" in video:  # a committed clip (the README's example), read as the recorder read it
            from tests.support.pixels import read_all_frames

            path = REPO / video["file"]
            out[video["clip"]] = (path, read_all_frames(path))
        else:
            frames = make_clip(*video["shape"])
            out[video["clip"]] = (write_clip(folder / f"{video['clip']}.avi", frames, video["fps"]), frames)
    return out


@pytest.fixture(scope="module")
def video_processor(toy_ckpt):
    from tests.support.mlx_vlm_run import load

    return load(str(toy_ckpt))[1].video_processor


def _max_frames(meta) -> dict:
    return meta["videos"][0].get("sampling", {}).get("processor", {})


def reference_text(meta, tokenizer_dir: pathlib.Path) -> str:
    """The reference's greedy ids decoded as the CLI prints them (up to the end-of-turn id)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    ids = list(meta["greedy_ids"])
    eos = json.loads((tokenizer_dir / "config.json").read_text())["eos_token_id"]
    return tokenizer.decode(ids[: ids.index(eos)] if eos in ids else ids)


@pytest.mark.parametrize("name", sorted(FILE_CASES))
def test_a_file_gives_the_reference_frames_and_times(clip_files, video_processor, name):
    meta = FILE_CASES[name]
    video = meta["videos"][0]
    path, frames = clip_files[video["clip"]]
    source = probe(str(path))
    assert (source.total_num_frames, source.fps) == (len(frames), video["fps"])
    got, metadata = read_video(str(path), lambda m: video_processor.sample_frames(m, **_max_frames(meta)))
    assert metadata.frames_indices == video["frames_indices"]
    np.testing.assert_array_equal(got, frames[video["frames_indices"]])


@pytest.mark.parametrize("name", sorted(FILE_CASES))
def test_cli_video_prints_the_reference_text(capsys, toy_ckpt, clip_files, name):
    meta = FILE_CASES[name]
    video = meta["videos"][0]
    prompt = next(p["text"] for p in meta["messages"][0]["content"] if p["type"] == "text")
    argv = ["generate", "--model", str(toy_ckpt), "--video", str(clip_files[video["clip"]][0])]
    argv += ["--prompt", prompt, "--max-tokens", str(len(meta["greedy_ids"])), "--temperature", "0", "--no-verbose"]
    if "max_frames" in _max_frames(meta):
        argv += ["--max-frames", str(_max_frames(meta)["max_frames"])]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.rstrip("\n") == reference_text(meta, toy_ckpt)


def test_cli_verbose_lists_the_frame_times(capsys, toy_ckpt, clip_files):
    meta = FILE_CASES["file_30fps_odd"]
    path = clip_files[meta["videos"][0]["clip"]][0]
    argv = ["generate", "--model", str(toy_ckpt), "--video", str(path), "--max-tokens", "2", "--temperature", "0"]
    assert cli.main(argv) == 0
    times = ", ".join(f"{i / 30.0:.2f}" for i in meta["videos"][0]["frames_indices"])
    assert f"Video: {path}: 5 frames at [{times}] s" in capsys.readouterr().out


@pytest.mark.parametrize("flag", [None, "--cap-pixels-per-frame", "--no-cap-pixels-per-frame"])
def test_cli_video_warning_names_the_flags(capsys, toy_ckpt, clip_files, flag):
    """Left unset, the reference's uncapped warning, in the words a command line takes; a flag silences it."""
    path = clip_files[FILE_CASES["file_30fps_odd"]["videos"][0]["clip"]][0]
    argv = ["generate", "--model", str(toy_ckpt), "--video", str(path), "--max-tokens", "1", "--no-verbose"]
    assert cli.main(argv + ([flag] if flag else [])) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "pixel cap" in line]
    if flag:
        assert warned == []
    else:
        assert len(warned) == 1 and "Pass --cap-pixels-per-frame to adopt the capped behavior" in warned[0]
        assert "or --no-cap-pixels-per-frame to keep the uncapped behavior" in warned[0]
        assert "cap_pixels_per_frame=" not in warned[0] and "`False`" not in warned[0]


def _stream_generate_takes_video() -> bool:
    from mlx_vlm import stream_generate

    return "video" in inspect.signature(stream_generate).parameters


@pytest.mark.skipif(not _stream_generate_takes_video(), reason="this mlx-vlm's stream_generate takes no video")
@pytest.mark.parametrize("name", ["file_24fps", "file_30fps_odd"])
def test_mlx_vlm_generate_with_video_reaches_the_native_path(toy_ckpt, clip_files, name):
    """mlx-vlm's own entry point: its chat formatting (video part), its file decoding, our
    processor natively (no frames fallback), the reference's prompt ids and greedy ids."""
    from mlx_vlm.prompt_utils import apply_chat_template

    from tests.support.cases import stream_ids
    from tests.support.mlx_vlm_run import load

    meta = FILE_CASES[name]
    path = str(clip_files[meta["videos"][0]["clip"]][0])
    model, processor = load(str(toy_ckpt))
    try:  # 0.6.12 on: the native path only for processors it judges to handle video
        from mlx_vlm.generate.video import processor_handles_video
    except ImportError:  # 0.6.3 hands every video to the processor
        pass
    else:
        assert processor_handles_video(processor)
    prompt_text = next(p["text"] for p in meta["messages"][0]["content"] if p["type"] == "text")
    prompt = apply_chat_template(processor, model.config, prompt_text, num_images=0, video=[path])
    assert prompt == meta["prompt"]
    fed = []
    ids = stream_ids(model, processor, prompt, None, len(meta["greedy_ids"]), fed=fed, video=[path])
    want = list(meta["greedy_ids"])
    eos = json.loads((toy_ckpt / "config.json").read_text())["eos_token_id"]
    want = want[: want.index(eos) + 1] if eos in want else want
    assert fed[0]["input_ids"].reshape(-1).tolist() == _reference_ids(name)
    assert ids == want


def _reference_ids(name: str):
    return video_case("toy", name)["input_ids"].reshape(-1).tolist()


# --------------------------------------------------------------------------- bad files


def test_errors_name_the_file_problem(tmp_path, capsys, toy_ckpt):
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(VideoFileError, match="cannot open .*corrupt.mp4 as a video"):
        probe(str(corrupt))
    cases = [
        (["--video", str(corrupt)], "cannot open"),
        (["--video", str(tmp_path / "missing.mp4")], "video file not found"),
        (["--fps", "2"], "--fps, --max-frames and --cap-pixels-per-frame need --video"),
        (["--video", str(corrupt), "--fps", "0"], "--fps must be positive"),
    ]
    for extra, message in cases:
        code = cli.main(["generate", "--model", str(toy_ckpt), *extra])
        err = capsys.readouterr().err
        assert code == 2 and message in err, (extra, err)


def test_missing_opencv_is_named(tmp_path, monkeypatch, clip_files):
    import sys

    path = next(iter(clip_files.values()))[0]
    monkeypatch.setitem(sys.modules, "cv2", None)
    with pytest.raises(VideoDecoderMissingError, match=r"compass-compat\[video\]"):
        probe(str(path))


def test_the_named_extra_installs_opencv():
    """The hint names an extra; pyproject.toml must declare it with the package mlx-vlm reads videos with."""
    import re

    import tomllib

    from compass_compat.video_files import INSTALL_HINT

    extra = re.search(r"compass-compat\[(\w+)\]", INSTALL_HINT).group(1)
    project = tomllib.loads((pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    wanted = project["optional-dependencies"][extra]
    assert any(re.match(r"opencv-python\b", req) for req in wanted), wanted


def test_cli_video_output_is_the_same_in_process_and_as_a_command(toy_ckpt, clip_files):
    """The in-process runs above are what the command prints (one subprocess, one case)."""
    import subprocess
    import sys

    meta = FILE_CASES["file_24fps"]
    path = clip_files[meta["videos"][0]["clip"]][0]
    argv = ["generate", "--model", str(toy_ckpt), "--video", str(path), "--prompt", "What moves in this video?"]
    argv += ["--max-tokens", "8", "--temperature", "0", "--no-verbose"]
    proc = subprocess.run([sys.executable, "-m", "compass_compat", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    assert proc.stdout == out.getvalue()
