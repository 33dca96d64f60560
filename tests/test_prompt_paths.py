"""The prompt paths of every pin render the published chat template's rules.

Expected prompts are transformers' own ``tokenizer.apply_chat_template`` on the checkpoint's
chat_template.jinja (the reference), never literals. Three paths:

- our processor (``apply_chat_template``, tokenize on or off, and its call): the reference's
  rendering and ids of the same messages;
- mlx-vlm's ``prompt_utils.apply_chat_template``: it rebuilds the messages before the template
  (measured): text parts (their ``text`` or ``content``) joined into one text part, image/video
  parts dropped and ``num_images`` image parts put first in the last user turn. So: what reaches the
  template renders as the reference renders it, and the final prompt equals the reference
  rendering of the equivalent messages listed below (where those differ from the input, mlx-vlm
  changed the meaning, not the template);
- mlx-vlm's server (``python -m compass_compat server``): what its request conversion hands to
  the template, recorded by a spy on ``prompt_utils.get_chat_template``, renders as the
  reference renders it, and equals the reference rendering of the request's messages; requests
  its schema refuses never reach the template (statuses recorded per pin).

Video: the template renders a video part; our processor renders it as the reference does and,
given frames, expands it as transformers does (every rule against recorded fixtures:
tests/test_video_processor.py). The token without frames (typed, or a video part whose frames
never reach the processor) raises ``VideoInputError``, saying how to pass them.
"""

from __future__ import annotations

import copy
import json
import os
import re
import urllib.error
import urllib.request
from pathlib import Path

import mlx_vlm
import numpy as np
import pytest
from packaging.version import Version

from tests.support.recorded import VIDEO_PROCESSOR_INDEX, video_processor_case
from tests.support.vendored import vendored

vendored()  # our processor on every pin (0.7.10: its default run)

VERSION = Version(str(mlx_vlm.__version__))
VIDEO_TOKEN = "<|VIDEO_PAD|>"
IMAGE_TOKEN = "<|IMAGE_PAD|>"

CASES = {
    "chatbot_role": [
        {"role": "user", "content": "Hi there."},
        {"role": "chatbot", "content": "Hello."},
        {"role": "user", "content": "Describe a compass."},
    ],
    "unknown_role": [
        {"role": "user", "content": "Hi there."},
        {"role": "tool", "content": "tool output"},
        {"role": "user", "content": "Describe a compass."},
    ],
    "image_url_part": [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "IMAGE"}},
                {"type": "text", "text": "What is this?"},
            ],
        },
    ],
    "content_only_part": [
        {
            "role": "user",
            "content": [{"type": "text", "content": "not rendered"}, {"type": "text", "text": "Describe a compass."}],
        },
    ],
    "system_list": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "image"}]},
        {"role": "user", "content": "Describe a compass."},
    ],
    "system_text_list": [  # what servers accept of system list content
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Describe a compass."},
    ],
    "video_part": [
        {
            "role": "user",
            "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "What happens?"}],
        },
    ],
}
NUM_IMAGES = {"image_url_part": 1}


def with_image(messages, source):
    """The case with its image_url placeholder pointing at ``source``."""
    messages = copy.deepcopy(messages)
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if "image_url" in part:
                part["image_url"]["url"] = str(source)
    return messages


@pytest.fixture(scope="module")
def image(fixture_images) -> Path:
    return fixture_images["synth_320x256.png"]


@pytest.fixture(scope="module")
def reference(tiny_ckpt_original):
    """transformers' own tokenizer of the checkpoint (unguarded), rendering its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_ckpt_original))

    def render(messages, add_generation_prompt=True):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    render.tokenizer = tokenizer
    return render


@pytest.fixture(scope="module")
def loaded(tiny_ckpt_original):
    from mlx_vlm.utils import load_config, load_processor

    return load_processor(tiny_ckpt_original), load_config(tiny_ckpt_original)


def reference_ids(reference, messages):
    # The template writes BOS itself: its ids are the rendering without added special tokens.
    return reference.tokenizer(reference(messages), add_special_tokens=False)["input_ids"]


def collapse_image_runs(ids, image_id):
    out = []
    for i in ids:
        if not (i == image_id and out and out[-1] == image_id):
            out.append(i)
    return out


# ------------------------------------------------------------- the template itself (reference)


def test_reference_renders_the_published_rules(reference):
    """The checkpoint's template, rendered by transformers, keeps the published rules."""
    cases = copy.deepcopy(CASES)
    as_assistant = [dict(m, role="assistant") if m["role"] == "chatbot" else m for m in cases["chatbot_role"]]
    assert reference(cases["chatbot_role"]) == reference(as_assistant)
    assert reference(cases["unknown_role"]) == reference([m for m in cases["unknown_role"] if m["role"] != "tool"])
    image_part = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    assert reference(cases["image_url_part"]) == reference(image_part)
    assert IMAGE_TOKEN in reference(image_part)
    assert reference(cases["content_only_part"]) == reference([{"role": "user", "content": "Describe a compass."}])
    assert reference(cases["system_list"]) == reference(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe a compass."}]
    )
    assert "<|VISION_START|>" + VIDEO_TOKEN + "<|VISION_END|>" in reference(cases["video_part"])
    turn = [{"role": "user", "content": "x"}]
    with_prompt, without = reference(turn), reference(turn, add_generation_prompt=False)
    assert with_prompt.startswith(reference.tokenizer.bos_token)
    assert with_prompt == without + "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"  # the published generation prompt


# ------------------------------------------------------------- our processor


@pytest.mark.parametrize("case", [c for c in CASES if c != "video_part"])
def test_processor_apply_chat_template_is_the_reference(loaded, reference, image, case):
    processor, _ = loaded
    messages = with_image(CASES[case], image)
    assert processor.apply_chat_template(messages, add_generation_prompt=True) == reference(messages)
    ids = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = collapse_image_runs(np.asarray(ids).reshape(-1).tolist(), processor.image_token_id)
    assert ids == reference_ids(reference, messages)


@pytest.mark.parametrize("case", [c for c in CASES if c != "video_part"])
def test_processor_call_tokenizes_the_reference_rendering(loaded, reference, image, case):
    processor, _ = loaded
    messages = with_image(CASES[case], image)
    text = reference(messages)
    images = [str(image)] * text.count(IMAGE_TOKEN) or None
    for add_special_tokens in (True, False):  # mlx-vlm passes True: still one BOS
        out = processor(text=text, images=images, add_special_tokens=add_special_tokens)
        ids = collapse_image_runs(np.asarray(out["input_ids"]).reshape(-1).tolist(), processor.image_token_id)
        assert ids == reference_ids(reference, messages), add_special_tokens


def video_fixture(name: str) -> dict:
    """A recorded case of tests/fixtures/video (transformers' processor on the same tiny checkpoint)."""
    return {**VIDEO_PROCESSOR_INDEX["cases"][name], "input_ids": video_processor_case(name)["input_ids"]}


def test_processor_takes_video_on_every_way_in(loaded, reference, image):
    from mlx_vlm.models.cohere_compass import processing_cohere_compass as pc
    from mlx_vlm.models.cohere_compass import video_processing_cohere_compass as vpc

    from compass_data.clips import make_clip

    processor, _ = loaded
    messages = CASES["video_part"]
    rendered = reference(messages)  # what the template makes of it
    assert processor.apply_chat_template(messages, add_generation_prompt=True) == rendered
    # Frames in the part: the reference's ids (recorded for the same rendering and frames).
    recorded = video_fixture("frames_no_metadata")
    assert recorded["prompt"] == rendered
    with_frames = copy.deepcopy(messages)
    with_frames[0]["content"][0]["video"] = make_clip(*recorded["clips"][0])
    with pytest.warns(vpc.VideoSettingsWarning):
        ids = processor.apply_chat_template(with_frames, add_generation_prompt=True, tokenize=True)
    assert np.asarray(ids).reshape(-1).tolist() == recorded["input_ids"].reshape(-1).tolist()
    # A file name is not decoded here: a named error says what to pass.
    with pytest.raises(pc.VideoInputError, match="Decode the file first"):
        processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    typed = [{"role": "user", "content": f"look {VIDEO_TOKEN} here"}]  # the token as text renders as text
    assert processor.apply_chat_template(typed, add_generation_prompt=True) == reference(typed)
    # The token with no frames, on every way in (mlx-vlm tokenizes text-only prompts itself).
    for call in (
        lambda: processor(text=rendered),
        lambda: processor(text=[reference(CASES["chatbot_role"]), rendered]),
        lambda: processor(text=rendered.replace(VIDEO_TOKEN, IMAGE_TOKEN) + VIDEO_TOKEN, images=[str(image)]),
        lambda: processor.tokenizer(rendered),
        lambda: processor.tokenizer.encode(rendered, add_special_tokens=False),
    ):
        with pytest.raises(pc.VideoInputError, match=re.escape(VIDEO_TOKEN)):
            call()
    # Frames with no token for them.
    with pytest.raises(pc.VideoInputError, match="0 <.*but 1 video"):
        processor(text=reference(CASES["chatbot_role"]), videos=[np.zeros((2, 32, 32, 3), np.uint8)])


def test_video_token_without_a_video_is_a_named_error(tiny_ckpt_original):
    """`python -m compass_compat generate` with the video token typed in and no --video: the
    processor's count error as the CLI's one-line error, exit 2, nothing generated."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "COMPASS_COMPAT_AUTOPATCH"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "compass_compat",
            "generate",
            "--model",
            str(tiny_ckpt_original),
            "--no-image",
            "--prompt",
            f"What happens in {VIDEO_TOKEN}?",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 2, run.stdout
    assert f"holds 1 {VIDEO_TOKEN} token(s)" in run.stderr and "no video was passed" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr  # the CLI's one-line error, not a crash
    assert "Generation:" not in run.stdout  # nothing generated


# ------------------------------------------------------------- mlx-vlm's apply_chat_template


def mlx_vlm_equivalent(case):
    """The messages mlx-vlm's apply_chat_template means (measured per pin; see the docstring)."""
    messages = CASES[case]
    joined = {
        "content_only_part": [{"role": "user", "content": "not rendered Describe a compass."}],
        "system_list": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe a compass."}],
        # mlx-vlm's formatter drops video parts for models it does not list; compass-compat's hook
        # puts them back where they reach it: 0.7 passes list content whole, 0.4-0.6 pass only its
        # text (a video then reaches the template only through video=, as the server passes it).
        "video_part": (
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
            if VERSION >= Version("0.7")
            else [{"role": "user", "content": "What happens?"}]
        ),
        "image_url_part": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
    }
    return joined.get(case, messages)


@pytest.mark.parametrize("case", list(CASES))
def test_mlx_vlm_apply_chat_template(loaded, reference, case):
    from mlx_vlm.prompt_utils import apply_chat_template

    processor, config = loaded
    messages = copy.deepcopy(CASES[case])
    num_images = NUM_IMAGES.get(case, 0)
    reached = apply_chat_template(processor, config, messages, num_images=num_images, return_messages=True)
    prompt = apply_chat_template(processor, config, messages, num_images=num_images)
    assert prompt == reference(reached)  # what reaches the template renders as the reference renders it
    assert prompt == reference(mlx_vlm_equivalent(case))
    if case not in ("content_only_part", "video_part"):
        assert prompt == reference(CASES[case])  # no change of meaning


def test_mlx_vlm_apply_chat_template_with_video_keeps_the_video_part(loaded, reference):
    """What mlx-vlm's CLI, generate and server pass (video=): the video part renders once where
    the template puts it, on every pin (mlx-vlm itself formats video only for models it lists)."""
    from mlx_vlm.prompt_utils import apply_chat_template

    processor, config = loaded
    prompt = apply_chat_template(processor, config, "What happens?", num_images=0, video=["clip.mp4"])
    assert prompt == reference(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    )


# ------------------------------------------------------------- mlx-vlm's server

SPY = """\
# compass-compat test spy: what reaches mlx-vlm's get_chat_template, and what it renders.
import json, os
import mlx_vlm.prompt_utils as _pu
_original = _pu.get_chat_template
def get_chat_template(processor, messages, *args, **kwargs):
    out = _original(processor, messages, *args, **kwargs)
    with open(os.environ["COMPASS_TEST_TEMPLATE_LOG"], "a", encoding="utf-8") as f:
        f.write(json.dumps({"messages": messages, "prompt": out}, default=repr) + "\\n")
    return out
_pu.get_chat_template = get_chat_template
"""
# Requests each pin's server schema refuses before the template (status by pin; 0.4.x serves
# /responses). Not listed: accepted (200).
REFUSED = {
    "chatbot_role": {"0.4": 422, "0.6": 422, "0.7": 422},
    "content_only_part": {"0.4": 422, "0.6": 422, "0.7": 422},
    "system_list": {"0.4": 422, "0.6": 422, "0.7": 422},  # for its image part
}


def pin_family() -> str:
    return f"{VERSION.major}.{VERSION.minor}"


@pytest.fixture(scope="module")
def server(tiny_ckpt_original, tmp_path_factory):
    from tests.support import server as ts

    pytest.importorskip("uvicorn", reason="mlx-vlm's server needs uvicorn and fastapi")
    spy = tmp_path_factory.mktemp("spy")
    (spy / "sitecustomize.py").write_text(SPY, encoding="utf-8")
    log = spy / "template.jsonl"
    started = ts.Server(
        tiny_ckpt_original, spy / "server.log", env={"COMPASS_TEST_TEMPLATE_LOG": str(log)}, path=[str(spy)]
    )
    with started:
        started.template_log = log
        yield started


def post(server, messages, max_tokens: int = 2):
    """(status, body text, what reached the template) of one request with these messages."""
    from tests.support import server as ts

    if ts.ROUTE.endswith("/responses"):

        def part(p):
            if p.get("type") == "image_url":
                return {"type": "input_image", "image_url": p["image_url"]["url"]}
            return {**p, "type": "input_text"} if p.get("type") == "text" else p

        items = [
            dict(m, content=[part(p) for p in m["content"]] if isinstance(m["content"], list) else m["content"])
            for m in messages
        ]
        body = {"model": server.model, "input": items, "max_output_tokens": max_tokens, "temperature": 0.0}
    else:
        body = {"model": server.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    before = server.template_log.read_text().splitlines() if server.template_log.exists() else []
    request = server.request(body)
    try:
        with urllib.request.urlopen(request, timeout=ts.REQUEST_TIMEOUT) as r:
            status, text = r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode("utf-8", "replace")
    after = server.template_log.read_text().splitlines() if server.template_log.exists() else []
    return status, text, [json.loads(line) for line in after[len(before) :]]


@pytest.mark.parametrize("case", [c for c in CASES if c != "video_part"])
def test_server_prompt_is_the_reference(server, reference, image, case):
    from tests.support import server as ts

    messages = with_image(CASES[case], ts.data_uri(image.read_bytes()))
    if case == "unknown_role":  # OpenAI tool messages carry the call they answer
        messages[1]["tool_call_id"] = "call_0"
    status, body, reached = post(server, messages)
    refused = REFUSED.get(case, {}).get(pin_family())
    if refused is not None:
        assert status == refused and not reached, f"{case}: {status} {body[:300]}"
        return
    assert status == 200, f"{case}: {status} {body[:500]}\n{server.tail()}"
    assert reached, "nothing reached the chat template"
    for record in reached:
        assert record["prompt"] == reference(record["messages"])
        assert record["prompt"] == reference(with_image(CASES[case], "IMAGE"))


def write_video(path: Path, frames: int = 4) -> Path:
    cv2 = pytest.importorskip("cv2", reason="a video file needs OpenCV (mlx-vlm reads videos with it)")
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 2.0, (64, 64))
    assert writer.isOpened(), "OpenCV cannot write mp4v here"
    for i in range(frames):
        writer.write(np.full((64, 64, 3), 40 * i, np.uint8))
    writer.release()
    return path


def test_server_refuses_the_video_token_with_the_processors_message(server):
    """The video token typed into a message with no video: the processor's count error, and the
    server stays up."""
    status, body, _ = post(server, [{"role": "user", "content": f"What happens in {VIDEO_TOKEN}?"}])
    assert status >= 400 and "no video was passed" in body, body
    assert post(server, [{"role": "user", "content": "Hello"}])[0] == 200, server.tail()


def server_passes_videos() -> bool:
    """Whether this mlx-vlm's server hands a request's video parts to the processor (0.6.12 on);
    the hook looked for is its OpenAI module's video-part reader, ``_extract_video_reference``."""
    try:
        import mlx_vlm.server.openai as openai_routes
    except ImportError:
        return False
    return hasattr(openai_routes, "_extract_video_reference")


def test_server_video_part_is_never_rendered_silently(server, tmp_path, tiny_ckpt_original, capsys):
    """A video part: refused by the schema (0.4-0.6.3); with upstream's processor live (0.7
    plain) turned into frames sent as images by mlx-vlm itself; with ours (0.6.12, 0.7 forced)
    rendered as the template renders it and answered with the CLI's text for the same clip."""
    from compass_compat import cli
    from compass_compat._patch import implementation_info
    from tests.support import server as ts

    video = write_video(tmp_path / "clip.mp4")
    messages = [
        {"role": "user", "content": [{"type": "video", "video": str(video)}, {"type": "text", "text": "What happens?"}]}
    ]
    status, body, reached = post(server, messages, max_tokens=6)
    ours = implementation_info().implementation == "vendored"
    if server_passes_videos() and ours:
        assert status == 200, f"{status} {body[:500]}\n{server.tail()}"
        assert reached and all(r["prompt"].count(VIDEO_TOKEN) == 1 for r in reached), reached
        argv = ["generate", "--model", str(tiny_ckpt_original), "--video", str(video), "--prompt", "What happens?"]
        assert cli.main([*argv, "--max-tokens", "6", "--temperature", "0", "--no-verbose"]) == 0
        assert ts.reply_text(json.loads(body)) == capsys.readouterr().out.rstrip("\n")
    elif server_passes_videos():  # upstream's processor takes no video: mlx-vlm's frames fallback
        assert all(VIDEO_TOKEN not in (r["prompt"] or "") for r in reached)
        assert status == 200, body
        assert reached and all(r["prompt"].count(IMAGE_TOKEN) >= 2 for r in reached), reached
    else:
        assert status >= 400 and not reached, f"{status} {body[:500]}"


@pytest.mark.skipif(not server_passes_videos(), reason="this mlx-vlm's server refuses video parts in its schema")
def test_server_answers_a_corrupt_video_with_an_error_and_stays_up(server, tmp_path):
    bad = tmp_path / "corrupt.mp4"
    bad.write_bytes(np.random.default_rng(1).integers(0, 256, 2048, dtype=np.uint8).tobytes())
    messages = [
        {"role": "user", "content": [{"type": "video", "video": str(bad)}, {"type": "text", "text": "What happens?"}]}
    ]
    status, body, _ = post(server, messages)
    assert status >= 400 and ("Cannot open video" in body or "cannot open" in body), f"{status} {body[:500]}"
    assert post(server, [{"role": "user", "content": "Hello"}])[0] == 200, server.tail()
