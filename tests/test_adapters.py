"""An adapter trained by mlx-vlm's own trainer gives the trained model's greedy text wherever it loads.

``scripts/train/trained_text.py`` trains the tiny checkpoint through the pin's trainer CLI (10
LoRA steps, or 10 full fine-tuning steps) in a fresh interpreter and records the greedy text of
the model the trainer holds when it ends (the expected text), the base model's text, the adapter
folder it wrote, and a checkpoint folder made from the trained model. Compared exactly with it:

- ``mlx_vlm.load(base, adapter_path=...)`` then mlx-vlm's stream_generate;
- ``python -m compass_compat generate --adapter-path``;
- mlx-vlm's server started with ``--adapter-path``, and a request's ``adapter_path`` on a server
  started without it (both pins with a server that has them: 0.6.x, 0.7.x);
- the checkpoint folder loaded with no adapter: LoRA layers fused (their own ``fuse()``; no pin has
  a fuse command for mlx-vlm models) or the full fine-tune's weights, beside the base's files;
- a full fine-tune's output folder as ``adapter_path`` where the pin reads one (0.7.x writes
  ``fine_tune_type: full`` in adapter_config.json; 0.6.x writes no config).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import pathlib
import subprocess
import sys
from typing import Dict

import mlx_vlm
import pytest
from packaging.version import Version

from tests.support.vendored import vendored

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train" / "trained_text.py"

vendored()  # skips the module when upstream's cohere_compass is live


def trainer_cli_or_skip() -> str:
    if importlib.util.find_spec("mlx_vlm.train"):
        return "mlx_vlm.train"
    if not importlib.util.find_spec("mlx_vlm.lora"):
        pytest.skip("this mlx-vlm has no trainer CLI (python -m mlx_vlm.train / mlx_vlm.lora)")
    if Version(mlx_vlm.__version__) < Version("0.5"):
        # As tests/test_training_modes.py; 0.4.4's lora also selects range(iters) dataset rows.
        pytest.skip(
            "mlx-vlm < 0.5's trainer CLI cannot train an image row: 0.4.x's iterate_batches cuts every row "
            "to 33 tokens (docs/fine-tuning.md, section 2)"
        )
    if not importlib.util.find_spec("datasets"):
        pytest.skip("python -m mlx_vlm.lora needs `datasets` (mlx-vlm's train extra), not installed here")
    return "mlx_vlm.lora"


def train(base: pathlib.Path, out: pathlib.Path, *flags: str) -> Dict[str, str]:
    trainer_cli_or_skip()
    paths = [str(ROOT)] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    cmd = [sys.executable, str(SCRIPT), "--model", str(base), "--out", str(out), "--fuse", *flags]
    proc = subprocess.run(cmd, env=env, cwd=out.parent, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        text = proc.stdout + proc.stderr
        if "mm_token_type_ids has" in text and "but input_ids has" in text:
            # The model's named refusal of 0.4.x's batching (docs/fine-tuning.md, section 2).
            pytest.skip("this mlx-vlm's trainer cuts every row before the image's tokens end: no image row trains")
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{text[-3000:]}")
    record = json.loads((out / "trained_text.json").read_text(encoding="utf-8"))
    # The check can fail: the training moved the greedy text away from the base's.
    assert record["trained_text"] and record["trained_text"] != record["base_text"], record
    return record


@pytest.fixture(scope="module")
def lora(tiny_ckpt_original, tmp_path_factory) -> Dict[str, str]:
    return train(tiny_ckpt_original, tmp_path_factory.mktemp("lora") / "run")


@pytest.fixture(scope="module")
def full(tiny_ckpt_original, tmp_path_factory) -> Dict[str, str]:
    return train(tiny_ckpt_original, tmp_path_factory.mktemp("full") / "run", "--full")


def greedy(model_dir, record: Dict[str, str], **load_kwargs) -> str:
    from mlx_vlm import load, stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(str(model_dir), **load_kwargs)
    formatted = apply_chat_template(processor, model.config, record["prompt"], num_images=1)
    pieces = stream_generate(
        model, processor, formatted, image=[record["image"]], max_tokens=record["max_tokens"], temperature=0.0
    )
    return "".join(piece.text for piece in pieces)


def cli_text(model_dir, record: Dict[str, str], *flags: str) -> str:
    from compass_compat import cli

    argv = ["generate", "--model", str(model_dir), "--image", record["image"], "--prompt", record["prompt"]]
    argv += ["--max-tokens", str(record["max_tokens"]), "--temperature", "0", "--no-verbose", *flags]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    return out.getvalue().removesuffix("\n")


def test_mlx_vlm_load_with_adapter_path_gives_the_trained_text(tiny_ckpt_original, lora):
    assert greedy(tiny_ckpt_original, lora, adapter_path=lora["adapters"]) == lora["trained_text"]
    assert greedy(tiny_ckpt_original, lora) == lora["base_text"]


def test_cli_adapter_path_gives_the_trained_text(tiny_ckpt_original, lora):
    assert cli_text(tiny_ckpt_original, lora, "--adapter-path", lora["adapters"]) == lora["trained_text"]
    assert cli_text(tiny_ckpt_original, lora) == lora["base_text"]


def test_cli_adapter_path_refuses_a_folder_without_weights(tiny_ckpt_original, lora, tmp_path, capsys):
    from compass_compat import cli

    argv = ["generate", "--model", str(tiny_ckpt_original), "--adapter-path", str(tmp_path), "--no-verbose"]
    assert cli.main(argv) != 0
    assert "no *.safetensors" in capsys.readouterr().err


def test_fused_lora_checkpoint_gives_the_trained_text(lora):
    assert json.loads((pathlib.Path(lora["checkpoint"]) / "config.json").read_text())  # a checkpoint folder
    assert greedy(lora["checkpoint"], lora) == lora["trained_text"]
    assert cli_text(lora["checkpoint"], lora) == lora["trained_text"]


def test_full_fine_tune_reloads_with_the_trained_text(tiny_ckpt_original, full):
    assert greedy(full["checkpoint"], full) == full["trained_text"]
    config = pathlib.Path(full["adapters"]) / "adapter_config.json"
    if not config.is_file():
        pytest.skip("this mlx-vlm's full fine-tune writes no adapter_config.json: it reloads as a checkpoint only")
    assert json.loads(config.read_text())["fine_tune_type"] == "full"
    assert greedy(tiny_ckpt_original, full, adapter_path=full["adapters"]) == full["trained_text"]
    assert cli_text(tiny_ckpt_original, full, "--adapter-path", full["adapters"]) == full["trained_text"]


@pytest.fixture(scope="module")
def servers(tiny_ckpt_original, lora, tmp_path_factory):
    """mlx-vlm's server with ``--adapter-path`` and one without it (a request names the adapter)."""
    from tests.support.server import VERSION, Server, serving

    if VERSION.major == 0 and VERSION.minor < 6:
        pytest.skip(f"mlx-vlm {VERSION}'s server routes are not the chat completions these requests use")
    logs = tmp_path_factory.mktemp("adapter_server_logs")
    started = {
        "flag": Server(tiny_ckpt_original, logs / "flag.log", "--adapter-path", lora["adapters"]),
        "request": Server(tiny_ckpt_original, logs / "request.log"),
    }
    with serving(started):
        yield started


def ask(server, record: Dict[str, str], **fields) -> str:
    import urllib.request

    from tests.support.server import REQUEST_TIMEOUT, data_uri, reply_text

    image = {"type": "image_url", "image_url": {"url": data_uri(pathlib.Path(record["image"]).read_bytes())}}
    content = [image, {"type": "text", "text": record["prompt"]}]
    body = {"model": server.model, "messages": [{"role": "user", "content": content}], "stream": False}
    body.update(max_tokens=record["max_tokens"], temperature=0.0, **fields)
    with urllib.request.urlopen(server.request(body, "/v1/chat/completions"), timeout=REQUEST_TIMEOUT) as r:
        assert r.status == 200, server.tail()
        return reply_text(json.loads(r.read()))


def test_server_adapter_path_flag_gives_the_trained_text(servers, lora):
    assert ask(servers["flag"], lora) == lora["trained_text"]


def test_server_request_adapter_path_gives_the_trained_text(servers, lora):
    assert ask(servers["request"], lora) == lora["base_text"]
    assert ask(servers["request"], lora, adapter_path=lora["adapters"]) == lora["trained_text"]
