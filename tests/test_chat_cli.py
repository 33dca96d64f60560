"""``python -m mlx_vlm.chat`` with this model, driven through pipes as a user's terminal would.

The chat runs as a user runs it with the opt-in patch (``compass_compat run -- python -m
mlx_vlm.chat``, i.e. ``COMPASS_COMPAT_AUTOPATCH=1``), in a throw-away interpreter holding this
tree's hook (tests/support/hook_venv.py). One chat per checkpoint reads a script on stdin:
a text turn, ``/clear``, ``/image``, a picture turn, then a follow-up on the same picture.

- The text and picture turns print ``python -m compass_compat generate``'s greedy text for the
  same message (tiny and default toy checkpoints).
- The follow-up turn (history kept; the chat reuses its prompt cache from the previous turn)
  prints what ``stream_generate`` gives for the whole history without any cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from compass_compat import startup
from compass_data.toy import build_toy_checkpoint
from tests.support import hook_venv
from tests.support.cli_run import greedy_cli_output

MAX_TOKENS = 12
TEXT_PROMPT = "Hello there"
IMAGE_PROMPT = "Describe this picture."
FOLLOW_UP = "How many shapes are there?"
DEMO = Path(__file__).resolve().parents[1] / "compass_compat" / "assets" / "demo.png"
ASSISTANT, YOU = "Assistant: ", "\nYou: "
# Where the pin's chat cuts a sliding-window cache that has wrapped (0.4.4 slices every cache to the
# reused prefix; the tiny checkpoint's window of 16 is shorter than the first turn): the model
# refuses by name. The toy's window covers the conversation.
FOLLOW_UP_REFUSED = {("0.4.4", "tiny"): "The sliding-window cache was set back to"}


@pytest.fixture(scope="module")
def hooked_python(tmp_path_factory) -> Path:
    return hook_venv.build(Path(sys.executable), tmp_path_factory.mktemp("chat_hooked") / "env")


@pytest.fixture(scope="module")
def toy_ckpt(tmp_path_factory) -> Path:
    return build_toy_checkpoint(tmp_path_factory.mktemp("toy"))


def chat_script(image: Path) -> str:
    return "\n".join([TEXT_PROMPT, "/clear", f"/image {image}", IMAGE_PROMPT, FOLLOW_UP, "/exit"]) + "\n"


def run_chat(python: Path, model: Path, script: str, cwd: Path) -> subprocess.CompletedProcess:
    """The chat on ``model`` fed ``script``; a plain pipe, no terminal (rich prints no colours)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({startup.ENV: "1", "TERM": "dumb", "COLUMNS": "400", "NO_COLOR": "1"})
    argv = [str(python), "-m", "mlx_vlm.chat", "--model", str(model)]
    argv += ["--temperature", "0", "--max-tokens", str(MAX_TOKENS)]
    # Every turn's error is printed and the loop goes on (EOF too): the script ends with /exit.
    return subprocess.run(argv, input=script, capture_output=True, text=True, env=env, cwd=str(cwd), timeout=600)


def turns(stdout: str) -> List[str]:
    """What the chat printed after each ``Assistant:`` up to its next prompt, in order."""
    out = []
    for piece in stdout.split(ASSISTANT)[1:]:
        out.append(piece.split(YOU, 1)[0])
    return out


@pytest.fixture(scope="module")
def chats(hooked_python, tiny_ckpt_original, toy_ckpt, tmp_path_factory) -> Dict[str, subprocess.CompletedProcess]:
    cwd = tmp_path_factory.mktemp("chat_cwd")  # outside the repo
    models = {"tiny": tiny_ckpt_original, "toy": toy_ckpt}
    return {name: run_chat(hooked_python, path, chat_script(DEMO), cwd) for name, path in models.items()}


def uncached_follow_up(model_path: Path, first_answer: str) -> str:
    """The follow-up turn's text from the pin's ``stream_generate`` on the whole history, no cache."""
    from mlx_vlm import load, stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(str(model_path))
    history = [
        {"role": "user", "content": [{"type": "text", "text": IMAGE_PROMPT}]},
        {"role": "assistant", "content": [{"type": "text", "text": first_answer}]},
        {"role": "user", "content": [{"type": "text", "text": FOLLOW_UP}]},
    ]
    prompt = apply_chat_template(processor, model.config, history, num_images=1, enable_thinking=False)
    chunks = stream_generate(model, processor, prompt, image=[str(DEMO)], max_tokens=MAX_TOKENS, temperature=0.0)
    return "".join(chunk.text for chunk in chunks)


@pytest.mark.parametrize("ckpt", ["tiny", "toy"])
def test_chat_turns_give_the_cli_greedy_text(chats, tiny_ckpt_original, toy_ckpt, ckpt):
    proc = chats[ckpt]
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    said = turns(proc.stdout)
    assert len(said) == 3, proc.stdout[-3000:]
    model = tiny_ckpt_original if ckpt == "tiny" else toy_ckpt
    text = greedy_cli_output(model, TEXT_PROMPT, MAX_TOKENS).rstrip("\n")
    picture = greedy_cli_output(model, IMAGE_PROMPT, MAX_TOKENS, DEMO).rstrip("\n")
    assert text.strip() and picture.strip()
    assert said[0].strip() == text.strip(), "text turn"
    assert said[1].strip() == picture.strip(), "picture turn"


@pytest.mark.parametrize("ckpt", ["tiny", "toy"])
def test_chat_follow_up_equals_the_uncached_history(chats, tiny_ckpt_original, toy_ckpt, ckpt):
    """0.4.4's chat puts the picture in the follow-up message, so the tokens after the reused
    prefix hold it (passed with the whole prompt's token types, unprimed): the model places it."""
    import mlx_vlm

    said = turns(chats[ckpt].stdout)
    assert len(said) == 3, chats[ckpt].stdout[-3000:]
    refused = FOLLOW_UP_REFUSED.get((str(mlx_vlm.__version__), ckpt))
    if refused:
        assert said[2].lstrip().startswith("Error:") and refused in said[2], said[2]
        return
    # The chat keeps its streamed answer as printed (unstripped) in the history.
    expected = uncached_follow_up(tiny_ckpt_original if ckpt == "tiny" else toy_ckpt, said[1])
    assert expected.strip()
    assert said[2].strip() == expected.strip()
