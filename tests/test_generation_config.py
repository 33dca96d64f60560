"""generation_config.json: the CLI samples and stops as the installed mlx-vlm's own generate does.

Every expectation is measured on this pin's mlx-vlm: ``mlx_vlm.load`` + ``stream_generate`` on
the same checkpoint, seeded the same way, with the sampling options left unset or passed; never
taken from ``compass_compat.cli``. Runs on whichever cohere_compass is live (upstream's on
0.7.10 with COMPASS_COMPAT_IMPLEMENTATION=upstream).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compass_compat import cli
from compass_data.tiny import build_tiny_checkpoint
from tests.support.generation_config import (
    GENERATION_CONFIGS,
    MAX_TOKENS,
    PROMPT,
    loaded,
    mlx_vlm_run,
    token_ids,
    with_generation_config,
)

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "do_sample")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("gencfg_base"))


def run_cli(capsys, path: Path, *flags: str, verbose: bool = False):
    """(exit code, stdout, stderr) of the CLI on ``path`` with the same prompt, text only."""
    argv = ["generate", "--model", str(path), "--no-image", "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), *flags]
    try:
        code = cli.main(argv + ([] if verbose else ["--no-verbose"]))
    except SystemExit as exc:  # argparse rejects a flag
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def cli_text(capsys, path: Path, *flags: str) -> str:
    code, out, err = run_cli(capsys, path, *flags)
    assert code == 0, err
    assert out.endswith("\n")
    return out[:-1]


@pytest.fixture(scope="module")
def published(base, tmp_path_factory) -> Path:
    return with_generation_config(
        base, tmp_path_factory.mktemp("gencfg_published"), GENERATION_CONFIGS["published"](token_ids())
    )


def test_the_published_sampling_defaults_change_the_text(published):
    # Guards the tests below: on this checkpoint, sampling with the file's values is not greedy.
    greedy = mlx_vlm_run(published, temperature=0.0)
    sampled = mlx_vlm_run(published, temperature=0.7, top_p=0.8)
    assert len(greedy.ids) == MAX_TOKENS and greedy.ids != sampled.ids


@pytest.mark.parametrize("name", list(GENERATION_CONFIGS))
def test_unset_sampling_flags_do_what_mlx_vlm_generate_does(capsys, base, tmp_path, name):
    path = with_generation_config(base, tmp_path, GENERATION_CONFIGS[name](token_ids()))
    assert cli_text(capsys, path) == mlx_vlm_run(path).text


def test_explicit_flags_override_the_file(capsys, published):
    assert cli_text(capsys, published, "--temperature", "0") == mlx_vlm_run(published, temperature=0.0).text
    flags = ("--temperature", "1.0", "--top-p", "0.9", "--seed", "7")
    want = mlx_vlm_run(published, seed=7, temperature=1.0, top_p=0.9)
    assert want.ids != mlx_vlm_run(published, temperature=0.0).ids
    assert cli_text(capsys, published, *flags) == want.text
    # Seeded just before generating: the same flags give the same text again.
    assert cli_text(capsys, published, *flags) == want.text


def test_top_k_is_passed_to_mlx_vlm(capsys, published):
    greedy = mlx_vlm_run(published, temperature=0.0)
    assert mlx_vlm_run(published, temperature=1.0, top_p=1.0, top_k=1).ids == greedy.ids  # the pin honours top_k
    code, out, err = run_cli(capsys, published, "--temperature", "1", "--top-p", "1", "--top-k", "1")
    assert code == 0 and out == greedy.text + "\n", err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temperature", "-0.5"], "--temperature: must be at least 0"),
        (["--temperature", "nan"], "--temperature: must be at least 0"),
        (["--top-p", "1.5"], "--top-p: must be between 0 and 1"),
        (["--top-k", "-1"], "--top-k: must be at least 0"),
        (["--top-k", "2.5"], "--top-k: not an integer"),
    ],
)
def test_bad_sampling_values_are_refused_before_loading(capsys, published, argv, message):
    code, out, err = run_cli(capsys, published, *argv)
    assert code == 2 and message in err and out == ""


def test_generation_stops_on_the_generation_config_eos(capsys, base, tmp_path):
    ids = token_ids()
    greedy = mlx_vlm_run(base, temperature=0.0)
    assert ids["eos_token_id"] not in greedy.ids  # the tiny weights keep end-of-turn from winning
    # A stop id the greedy run reaches at step k (first occurrence), named only in generation_config.json.
    k = next(i for i in range(2, len(greedy.ids)) if greedy.ids[i] not in greedy.ids[:i])
    stop = greedy.ids[k]
    path = with_generation_config(base, tmp_path, {**ids, "eos_token_id": stop})
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == ids["eos_token_id"]

    model, _ = loaded(str(path))
    eos = model.config.eos_token_id
    reads_the_file = stop in (eos if isinstance(eos, list) else [eos])  # as mlx-vlm's load decides
    want = mlx_vlm_run(path, temperature=0.0)
    if reads_the_file:
        assert want.ids[:k] == greedy.ids[:k] and len(want.ids) == k + 1 and want.ids[k] == stop
    else:  # this pin's load ignores generation_config.json: config.json's eos only
        assert want.ids == greedy.ids
    assert cli_text(capsys, path, "--temperature", "0") == want.text
