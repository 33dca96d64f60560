"""What the README and docs show a newcomer equals what the commands print today.

- Every output block marked ``<!-- sample: ARGS -->`` (the block right after the marker) is what
  ``python -m compass_compat ARGS`` prints, line for line in order: ``...`` in a sample line
  stands for any text, speeds (``tokens-per-sec``, ``GB``) for any figure, and ``[compass-compat]``
  progress lines are left out (they depend on what is already built). The home folder prints as
  ``~``.
- The default checkpoint's answer table (prompt | answer) is what ``generate --no-verbose`` prints.
- The environment table names the versions the committed constraints files pin.
- The README names the items upstream's package fails on 0.7.10 as the record does.

The samples were printed on mlx-vlm 0.6.12 (the README's set-up pin): they run there and skip,
saying so, elsewhere; the tables are checked on every pin.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

import mlx_vlm
import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "CHECKLIST.md"]
SAMPLE_PIN = "0.6.12"
on_sample_pin = pytest.mark.skipif(
    str(mlx_vlm.__version__) != SAMPLE_PIN,
    reason=f"the samples show what mlx-vlm {SAMPLE_PIN} prints (the README's set-up); this is {mlx_vlm.__version__}",
)


def _samples() -> Iterator[Tuple[str, str, List[str]]]:
    """(document, ARGS, the block's lines) of every marked sample."""
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for match in re.finditer(r"<!-- sample: (.+?) -->\s*\n```[a-z]*\n(.*?)```", text, re.S):
            yield doc.name, match.group(1), match.group(2).splitlines()


SAMPLES = list(_samples())


def _run(args: List[str]) -> List[str]:
    from compass_compat import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(args)
    assert code == 0, f"python -m compass_compat {shlex.join(args)} exited {code}"
    text = out.getvalue().replace(str(Path.home()), "~")
    return text.splitlines()


def _pattern(line: str) -> "re.Pattern[str]":
    parts = [re.escape(part) for part in line.split("...")]
    pattern = ".*".join(parts)
    pattern = re.sub(r"\d+\\\.\d+(\\ (?:tokens\\-per\\-sec|GB))", r"[\\d.]+\1", pattern)
    return re.compile(pattern + r"\Z")


def test_the_docs_mark_their_samples():
    assert {doc for doc, _, _ in SAMPLES} >= {"README.md"} and len(SAMPLES) >= 2, SAMPLES


@on_sample_pin
@pytest.mark.parametrize("doc,args,lines", SAMPLES, ids=[f"{d}:{a}" for d, a, _ in SAMPLES])
def test_a_sample_is_what_the_command_prints(doc, args, lines, monkeypatch):
    monkeypatch.chdir(REPO)  # the README's commands run from the checkout
    printed = _run(shlex.split(args))
    wanted = [line for line in lines if line.strip() and not line.startswith("[compass-compat]") and line != "..."]
    at = 0
    for line in wanted:
        pattern = _pattern(line)
        while at < len(printed) and not pattern.match(printed[at]):
            at += 1
        assert at < len(printed), f"{doc}: `{line}` is not printed (in order) by {args}:\n" + "\n".join(printed)
        at += 1


def _table(doc: Path, header: str) -> List[List[str]]:
    lines = doc.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


@on_sample_pin
def test_the_default_checkpoints_answer_table_is_what_it_answers(monkeypatch):
    monkeypatch.chdir(REPO)
    rows = _table(REPO / "README.md", "| prompt | demo picture: the toy's answer |")
    assert len(rows) == 4
    for prompt, answer in rows:
        printed = _run(["generate", "--prompt", prompt.strip("`"), "--no-verbose"])
        assert printed == [answer.split(" (")[0].strip("`")], (prompt, printed)


def test_the_environment_table_names_the_recorded_versions():
    rows = _table(REPO / "README.md", "| env | mlx | mlx-vlm | mlx-lm | transformers | torch |")
    assert len(rows) >= 6
    for env, mlx, vlm, lm, tf, torch, _why in rows:
        frozen = (REPO / "scripts" / "env" / "constraints" / f"mlxvlm-{env.strip('`')}.txt").read_text()
        pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", frozen, re.M))
        got = {"mlx": mlx, "mlx-vlm": vlm, "mlx-lm": lm, "transformers": tf}
        assert got == {k: pins[k] for k in got}, env
        assert torch == "-" or torch.split()[0] == pins["torch"], env


def test_the_readme_names_upstreams_failing_items_as_recorded():
    record = json.loads((REPO / "compass_compat" / "verdicts.json").read_text(encoding="utf-8"))
    failing = [n for n, v in record["releases"]["0.7.10"]["upstream"].items() if v == "FAIL"]
    said = re.search(r"on mlx-vlm\s+0\.7\.10 upstream's fails items ([\d, and]+?) \(", (REPO / "README.md").read_text())
    assert said, "README.md no longer names 0.7.10's failing items"
    assert re.findall(r"\d+", said.group(1)) == failing


def test_every_script_the_docs_name_exists():
    """A command a newcomer copies names a file that is there (the constraints files once named
    make_envs.sh, which had become scripts/env/build.sh)."""
    texts = [p for p in DOCS] + sorted((REPO / "scripts" / "env" / "constraints").glob("*.txt"))
    missing = set()
    for path in texts:
        for paragraph in re.split(r"\n\s*\n", path.read_text()):
            for name in re.findall(
                r"(?<![\w/.-])((?:scripts|tests|compass_compat|compass_data)/[\w/.-]+\.(?:py|sh|json|md))", paragraph
            ):
                if not (REPO / name).exists() and not _at_a_cited_commit(name, paragraph):
                    missing.add(f"{path.relative_to(REPO)}: {name}")
    assert not missing, sorted(missing)


def _at_a_cited_commit(name: str, paragraph: str) -> bool:
    """A file that left the tree, cited with a commit of the same paragraph that holds it."""
    revs = re.findall(r"\b[0-9a-f]{7,40}\b", paragraph)
    git = ["git", "-C", str(REPO), "cat-file", "-e"]
    return any(subprocess.run([*git, f"{rev}:{name}"], capture_output=True).returncode == 0 for rev in revs)


SETUP_ENV = REPO / ".venvs" / f"mlxvlm-{SAMPLE_PIN}"
THE_TEST_COMMAND = "bash .ci/run"  # what is running this test


def _readme_command_lines() -> List[str]:
    """Every line of the README's bash blocks, in order; a block marked ``<!-- not run`` (it
    installs into the reader's own environment) is left out."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    lines = []
    for match in re.finditer(r"(<!-- not run[^\n]*-->\s*\n)?```bash\n(.*?)```", text, re.S):
        if not match.group(1):
            lines += [line for line in match.group(2).splitlines() if line.strip() and not line.startswith("#")]
    return lines


def test_the_readme_command_lines_are_the_ones_run_below():
    lines = _readme_command_lines()
    assert lines[0].startswith(f"bash scripts/env/build.sh {SAMPLE_PIN} && ") and lines[1] == THE_TEST_COMMAND
    assert not [line for line in lines if re.search(r"\b(PATH|IMG|TEXT|DIR|FILE)\b", line)], "placeholders"
    assert not [line for line in lines if re.match(r"python3? ", line)] or any(
        line.startswith("source .venvs/") for line in lines
    ), "a bare `python` line without the set-up's environment activated"


@on_sample_pin
@pytest.mark.skipif(
    Path(sys.prefix).resolve() != SETUP_ENV.resolve(), reason=f"runs in the README's set-up environment {SETUP_ENV}"
)
def test_the_readme_command_lines_run_as_written_in_order(tmp_path):
    """On a fresh home (the default checkpoint built anew), in one shell from the checkout, each
    line as written; a server line runs in the background until it answers /health."""
    script = ["set -e"]
    for line in _readme_command_lines():
        if line == THE_TEST_COMMAND:
            continue
        if "mlx_vlm.server" in line:
            script += [
                f"{line} > {tmp_path}/server.log 2>&1 &",
                "server=$!",
                "for i in $(seq 300); do curl -sf http://127.0.0.1:8080/health >/dev/null && break; sleep 1; done",
                "curl -sf http://127.0.0.1:8080/health",
                "kill $server; wait $server || true",
            ]
        else:
            script.append(line)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPASS_COMPAT", "VIRTUAL_ENV"))}
    env.update(HOME=str(tmp_path), HF_HUB_OFFLINE="1", PATH=os.environ.get("PATH", ""))
    proc = subprocess.run(
        ["bash", "-c", "\n".join(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.count("A blue square and a yellow star.") >= 2, proc.stdout  # ours and mlx-vlm's CLI
    assert "Two." in proc.stdout and "A blue square." in proc.stdout, proc.stdout
