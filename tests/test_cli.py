"""``python -m compass_compat``: generate (default checkpoint, demo picture), mlx-vlm's converter through
``run``, info, errors, help."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import compass_compat
from compass_compat import cli
from compass_data import shapes, toy

REPO = Path(__file__).resolve().parents[1]


def cli_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("COMPASS_COMPAT_AUTOPATCH", "PYTHONPATH")}
    env["COMPASS_COMPAT_HOME"] = str(home)
    return env


def run_cli(*args, home: Path, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "compass_compat", *map(str, args)],
        capture_output=True,
        text=True,
        env=cli_env(home),
        cwd=str(home),
        timeout=timeout,
    )
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def main_in_process(capsys, *argv):
    """(exit code, stdout, stderr) of cli.main, SystemExit (argparse --help) included."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------------- generate


def _generate_samples_by_the_file() -> bool:
    """mlx-vlm 0.7.x's generate fills unset sampling flags from generation_config.json (0.6.12 and older: greedy)."""
    try:
        from mlx_vlm.generate.common import resolve_sampling_defaults  # noqa: F401
    except ImportError:
        return False
    return True


def test_generate_with_no_arguments_builds_the_default_checkpoint_once(tmp_path, monkeypatch, capsys):
    # The README's command, in a fresh process: build the default checkpoint, generate from the demo picture.
    first = run_cli("generate", home=tmp_path)
    ckpt = tmp_path / toy.DEFAULT_CHECKPOINT
    # Building shows progress, on stderr.
    assert f"building the default checkpoint in {ckpt}" in first.stderr
    assert "[1/3]" in first.stderr and "[3/3]" in first.stderr and "done:" in first.stderr
    # The output says the checkpoint is a toy and which picture was used.
    assert "a TOY" in first.stdout
    assert str(cli.generate.DEMO_IMAGE) in first.stdout
    assert re.search(r"Generation: \d+ tokens", first.stdout)
    text = first.stdout.split("=" * 10 + "\n")[2].rstrip("\n")
    # The toy answers the demo picture correctly where our model runs and the pin decodes
    # greedily by default (0.7.10 samples from generation_config.json; upstream's model differs).
    if compass_compat.implementation_info().implementation == "vendored" and not _generate_samples_by_the_file():
        assert text.strip() == shapes.demo_questions()["describe"].answer, first.stdout
    else:
        assert text.strip(), first.stdout
    # A real checkpoint folder: CohereLabs layout, real special tokens and chat template.
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "cohere_compass" and "a TOY" in (ckpt / "README.md").read_text()
    assert (ckpt / "chat_template.jinja").is_file() and (ckpt / "preprocessor_config.json").is_file()
    assert toy.default_checkpoint_problem(ckpt) is None

    monkeypatch.setenv("COMPASS_COMPAT_HOME", str(tmp_path))
    code, out, err = main_in_process(capsys, "generate", "--no-verbose")
    assert code == 0 and "building" not in err
    assert "a TOY" in err  # --no-verbose: only the text on stdout, the note on stderr
    assert out == text + "\n"  # seeded (--seed 0) even where the checkpoint's defaults sample


def test_a_damaged_default_checkpoint_is_rebuilt(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COMPASS_COMPAT_HOME", str(tmp_path))
    ckpt = toy.ensure_default_checkpoint()
    (ckpt / "config.json").write_text("{}")
    assert toy.default_checkpoint_problem(ckpt) == "config.json changed since it was built"
    assert toy.ensure_default_checkpoint() == ckpt
    assert "config.json changed since it was built" in capsys.readouterr().err
    assert toy.default_checkpoint_problem(ckpt) is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging folders left behind"


def test_a_default_checkpoint_built_from_older_toy_weights_is_rebuilt(tmp_path, monkeypatch, capsys):
    """An upgrade that ships retrained weights must not keep answering with the cached old ones."""
    monkeypatch.setenv("COMPASS_COMPAT_HOME", str(tmp_path))
    ckpt = toy.ensure_default_checkpoint()
    original = toy.WEIGHTS_FILE
    shipped = tmp_path / "retrained.safetensors"
    shipped.write_bytes(toy.WEIGHTS_FILE.read_bytes() + b" ")  # any other bytes
    monkeypatch.setattr(toy, "WEIGHTS_FILE", shipped)
    assert toy.default_checkpoint_problem(ckpt) == "built from other toy weights than this compass-compat ships"
    monkeypatch.setattr(toy, "WEIGHTS_FILE", original)
    assert toy.default_checkpoint_problem(ckpt) is None


def _reference_text(case, tokenizer_dir: Path) -> str:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    ids = case["greedy_ids"].tolist()
    eos = json.loads((tokenizer_dir / "config.json").read_text())["eos_token_id"]
    if eos in ids:  # mlx-vlm stops there and prints nothing for it
        ids = ids[: ids.index(eos)]
    return tokenizer.decode(ids)


@pytest.mark.parametrize("name", ["img_448", "img_two"])
def test_generate_prints_the_transformers_greedy_text(capsys, tiny_ckpt_original, reference, fixture_images, name):
    """The CLI's text for a reference case is the decoded greedy ids transformers recorded."""
    from tests.support.vendored import vendored

    vendored()  # the reference is transformers' model; upstream 0.7.10's differs
    case = reference(name)
    meta = case["meta"]
    user = meta["messages"][0]["content"]
    prompt = user if isinstance(user, str) else next(p["text"] for p in user if p["type"] == "text")
    images = []
    for f in meta["images"]:
        images += ["--image", fixture_images[f]]  # repeated --image, as in mlx-vlm's CLI
    code, out, err = main_in_process(
        capsys,
        "generate",
        "--model",
        str(tiny_ckpt_original),
        *map(str, images),
        "--prompt",
        prompt,
        "--max-tokens",
        str(len(case["greedy_ids"])),
        "--temperature",
        "0",
        "--no-verbose",
    )
    assert code == 0, err
    assert out.rstrip("\n") == _reference_text(case, tiny_ckpt_original)
    assert "a TOY" not in err  # an explicit --model is not labelled as the default


@pytest.fixture(scope="module")
def few_positions(tmp_path_factory) -> Path:
    """The tiny checkpoint with 16 positions, so a sentence is a prompt past them."""
    from compass_data.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("few") / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 16
    (path / "config.json").write_text(json.dumps(config))
    return path


LONG_PROMPT = "Where is the blue square? " * 20
PAST_POSITIONS = re.compile(
    r"cohere_compass: the prompt is (\d+) tokens, longer than this checkpoint's max_position_embeddings \(16\); "
    r"the answer cannot be trusted"
)


@pytest.mark.parametrize("entry", ["compass_compat", "mlx_vlm.generate"])
def test_a_prompt_past_the_positions_gets_one_warning_line(few_positions, tmp_path, entry):
    """From the model package, so mlx-vlm's own CLI shows it too; the header shortens the prompt."""
    from tests.support.vendored import vendored

    vendored()  # the warning is our package's
    env = {**cli_env(tmp_path), "COMPASS_COMPAT_AUTOPATCH": "1"}
    command = ["generate"] if entry == "compass_compat" else []
    proc = subprocess.run(
        [sys.executable, "-m", entry, *command, "--model", few_positions, "--max-tokens", "2", "--prompt", LONG_PROMPT],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "max_position_embeddings" in line]
    assert len(warned) == 1 and PAST_POSITIONS.fullmatch(warned[0]) and int(PAST_POSITIONS.fullmatch(warned[0])[1]) > 16
    if entry == "compass_compat":
        shown = next(line for line in proc.stdout.splitlines() if line.startswith("Prompt: "))
        assert len(shown) < 300 and f"[... {len(LONG_PROMPT) - 200:,} characters ...]" in shown, shown


def test_a_prompt_within_the_positions_warns_nothing(tiny_ckpt_original, capsys, caplog):
    code, _, err = main_in_process(
        capsys,
        "generate",
        "--model",
        str(tiny_ckpt_original),
        "--no-image",
        "--max-tokens",
        "2",
        "--prompt",
        LONG_PROMPT,
    )
    assert code == 0, err
    assert not [r for r in caplog.records if "max_position_embeddings" in r.getMessage()]


# -------------------------------------------------------------------------- convert


def test_run_quantizes_through_the_patched_mlx_vlm_converter(tmp_path, tiny_ckpt_original, capsys):
    """The command docs/usage.md shows: mlx-vlm's converter under ``run``, then generate on its output."""
    out = tmp_path / "q4"
    proc = run_cli(
        "run",
        "--",
        sys.executable,
        "-m",
        "mlx_vlm.convert",
        "--hf-path",
        tiny_ckpt_original,
        "--mlx-path",
        out,
        "-q",
        "--q-bits",
        "4",
        "--q-group-size",
        "64",
        home=tmp_path,
        timeout=600,
    )
    assert "Quantiz" in proc.stdout + proc.stderr  # mlx-vlm's own progress lines
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    code, text, stderr = main_in_process(capsys, "generate", "--model", str(out), "--max-tokens", "4", "--no-verbose")
    assert code == 0 and text.strip(), stderr


# ----------------------------------------------------------------------------- info


def test_info_reports_the_live_implementation_and_the_hook(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COMPASS_COMPAT_HOME", str(tmp_path))
    code, out, _ = main_in_process(capsys, "info", "--json")
    assert code == 0
    data = json.loads(out)
    here = compass_compat.implementation_info()
    assert data["implementation"] == here.implementation and data["forced"] == here.forced
    assert data["mlx_vlm_version"] == here.mlx_vlm_version
    assert data["default_checkpoint"] == str(tmp_path / toy.DEFAULT_CHECKPOINT)
    assert data["default_checkpoint_state"] == "not built yet"
    assert [Path(p).name for p in data["startup_hook"]] == ["compass_compat_autopatch.pth"]


# --------------------------------------------------------------------- help, errors


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--help"], ["generate", "server", "run", "info"]),
        (
            ["generate", "--help"],
            [
                "--model",
                "--image",
                "--prompt",
                "--max-tokens",
                "--temperature",
                "--top-p",
                "--top-k",
                "--seed",
                "generation_config.json",
                "--draw-boxes",
                "--box-image-index",
                "toy default checkpoint",
            ],
        ),
        (["server", "--help"], ["default checkpoint", "--port"]),
        (["run", "--help"], ["COMPASS_COMPAT_AUTOPATCH", "mlx_vlm.generate"]),
        (["info", "--help"], ["--json"]),
    ],
)
def test_every_subcommand_has_help(capsys, monkeypatch, argv, words):
    monkeypatch.setattr(sys, "argv", ["compass_compat"])
    code, out, _ = main_in_process(capsys, *argv)
    assert code == 0
    flat = " ".join(out.split())
    for word in words:
        assert word in flat, f"{word!r} missing from {' '.join(argv)}:\n{out}"
    assert os.environ.get("COMPASS_COMPAT_AUTOPATCH") is None  # help changes nothing


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--model", "/nonexistent/ckpt"], "model folder not found: /nonexistent/ckpt"),
        (["generate", "--model", "{tmp}"], "has no config.json: it is not a model checkpoint folder"),
        (
            ["generate", "--model", "{ckpt}", "--image", "/nonexistent/pic.png"],
            "image file not found: /nonexistent/pic.png",
        ),
        (["generate", "--model", "{ckpt}", "--image", "{ckpt}/config.json", "--no-image"], "--no-image and --image"),
        # A file that is not a picture, a folder, an empty question: one line each, before any load
        # (were: a 34-line traceback after the header; "image file not found"; accepted silently).
        (
            ["generate", "--model", "{ckpt}", "--image", "{ckpt}/config.json"],
            "config.json is not an image Pillow can read",
        ),
        (["generate", "--model", "{ckpt}", "--image", "{tmp}"], "is a folder, not an image file"),
        (["generate", "--model", "{ckpt}", "--prompt", ""], "--prompt is empty"),
        (["generate", "--model", "{ckpt}", "--prompt", "  "], "--prompt is empty"),
        (["server", "--model", "/nonexistent/ckpt", "--port", "1"], "model folder not found: /nonexistent/ckpt"),
        (["run"], "run needs a command"),
        (
            ["run", "--", "compass-compat-no-such-command-4711"],
            "command not found: compass-compat-no-such-command-4711",
        ),
    ],
)
def test_errors_say_what_is_missing(capsys, tmp_path, tiny_ckpt_original, argv, message):
    argv = [a.format(tmp=tmp_path, ckpt=tiny_ckpt_original) for a in argv]
    code, out, err = main_in_process(capsys, *argv)
    assert code == 2
    assert message in err
    assert err.startswith(f"python -m compass_compat {argv[0]}: error:"), err
    assert "Traceback" not in err


def test_video_with_upstreams_processor_says_how_to_get_video(capsys, tiny_ckpt_original, tmp_path):
    """Where upstream's cohere_compass is live (COMPASS_COMPAT_IMPLEMENTATION=upstream) its processor takes no video:
    --video is refused with the switch that gives the vendored one, never sent as stills."""
    if compass_compat.implementation_info().implementation != "upstream":
        pytest.skip("the vendored package is live: tests/test_video_entry.py runs --video")
    import cv2

    from compass_data.clips import make_clip

    clip = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(str(clip), cv2.VideoWriter_fourcc(*"FFV1"), 2.0, (64, 64))
    for frame in make_clip(4, 64, 64):
        writer.write(frame[..., ::-1].copy())
    writer.release()
    code, out, err = main_in_process(capsys, "generate", "--model", str(tiny_ckpt_original), "--video", str(clip))
    assert code == 2 and "takes no video" in err and "COMPASS_COMPAT_IMPLEMENTATION=vendored" in err, err


BLOCK_MLX = """
import sys
class _NoBackend:  # what plain `pip install mlx` gives on Linux: libmlx.so is missing
    def find_spec(self, name, path=None, target=None):
        if name == "mlx.core":
            raise OSError("libmlx.so: cannot open shared object file: No such file or directory")
sys.meta_path.insert(0, _NoBackend())
"""


def test_without_a_loadable_mlx_help_and_info_run_and_the_rest_says_what_to_install(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCK_MLX)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(tmp_path), str(REPO)))}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
        )

    helped, info, generate, imported = (
        run("-m", "compass_compat", "--help"),
        run("-m", "compass_compat", "info"),
        run("-m", "compass_compat", "generate"),
        run("-c", "import compass_compat"),
    )
    assert helped.returncode == 0 and "generate" in helped.stdout, helped.stderr
    assert info.returncode == 1 and info.stdout.startswith("problem") and "compass-compat[cpu]" in info.stdout
    assert generate.returncode == 2 and generate.stderr.count("\n") == 1, generate.stderr
    assert "mlx cannot load here" in generate.stderr and "compass-compat[cpu]" in generate.stderr
    # A library import is never silently unpatched: it raises one error, naming what to install
    # from the package index and from a checkout, without the frames behind it.
    assert imported.returncode != 0 and "CompassCompatError: mlx cannot load here" in imported.stderr
    assert "pip install 'compass-compat[cpu]'" in imported.stderr and "pip install '.[cpu]'" in imported.stderr
    assert imported.stderr.count("Traceback") == 1 and imported.stderr.count('  File "') == 2, imported.stderr
