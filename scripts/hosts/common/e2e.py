"""The host end-to-end driver: requests, reference answers, prompt check, server, probe, table.

A host script (scripts/hosts/<host>/e2e.py) describes its host as a :class:`Host` (how to
start its server, what a request body looks like there, which phases and requests to run, an
optional in-process prompt check) and calls :func:`main`. The run:

1. copies the default checkpoint (compass_data.toy.ensure_default_checkpoint, as
   `python -m compass_compat generate` finds it) to OUT/models/toy-shapes-v5;
2. computes the expected answer of every distinct request with one
   `python -m compass_compat generate --temperature 0` process each (fresh processes: nothing
   carries over between requests);
3. where the host has one, runs its prompt check in this process (what the host's own prompt
   pipeline hands mlx-vlm against what the CLI hands it); a request whose inputs differ fails;
4. for every phase, starts the host's server on 127.0.0.1 with the documented opt-in
   (COMPASS_COMPAT_AUTOPATCH=1, no other flag: where the installed mlx-vlm ships its own
   cohere_compass the recorded verdicts make the vendored one live) and the probe (scripts/hosts/common/probe) on its
   PYTHONPATH, sends the phase's requests (greedy, fixed max_tokens; sequential ones in order,
   then the concurrent group at once), and always stops the server;
5. reads the probe's report from inside the host's processes: the vendored package must be
   the live one (compass_compat.implementation_info()), or every request of the phase fails;
6. prints `host | request | expected | got | equal`, writes OUT/results.json and
   OUT/table.md, and exits 1 on any difference (2 when the environment is not usable).

`--source DIR` runs another checkout's compass_compat/compass_data/vendor (DIR goes first on
PYTHONPATH of the reference processes and the server), e.g. /work/main after a fix; the
probe records which compass_compat the host imported; `--git-rev REV` runs REV's, exported
with `git archive` to OUT/src-<sha>. Host executables start as `python <console script>` of this
interpreter: a moved environment keeps its scripts' old `#!` lines.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import mimetypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:  # run as a file: the host scripts import scripts.hosts.common.e2e
    sys.path.insert(0, str(ROOT))

from tests.support.server import Process, free_port  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "images"
PROBE_DIR = Path(__file__).resolve().parent / "probe"
MODEL_ID = "toy-shapes-v5"  # compass_data.toy.DEFAULT_CHECKPOINT; checked in prepare_model_dir
AUTOPATCH = "COMPASS_COMPAT_AUTOPATCH"
FORCE = "COMPASS_COMPAT_FORCE_VENDORED"
SOURCES = ("compass_compat", "compass_data", "vendor")  # what --git-rev exports


# --------------------------------------------------------------------------- requests
@dataclass
class Case:
    """One chat request: a single user turn, image parts first, then video parts, then one text part."""

    name: str
    images: List[str]
    text: str
    what: str
    stream: bool = False
    group: str = "sequential"  # "sequential" or "concurrent"
    # Sent as video_url parts to a host documented to drop them: the reference is the request without them.
    dropped_videos: List[str] = field(default_factory=list)

    def key(self) -> Tuple[Tuple[str, ...], str, Tuple[str, ...]]:
        return tuple(self.images), self.text, tuple(self.dropped_videos)


@dataclass
class Phase:
    """One server start: extra arguments/environment and the requests sent to it."""

    name: str
    cases: List[Case]
    args: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)
    note: str = ""


@dataclass
class Host:
    """What a host run needs to know about the host."""

    name: str  # e.g. "lmstudio"
    label: str  # e.g. "LM Studio's engine (mlx-engine 08f0c07)"
    distributions: List[str]  # reported versions
    command: Callable[[Path, int], List[str]]  # (model dir, port) -> argv
    # Built after --source is on sys.path: the request set names files of the package it tests.
    phases: Callable[[], List[Phase]]
    ready_path: str = "/v1/models"  # GET path that answers 200 once the model is loaded
    ready_check: Optional[Callable[[Any], Optional[str]]] = None  # JSON -> error or None (default: lists_model)
    headers: Dict[str, str] = field(default_factory=dict)
    env: Dict[str, str] = field(default_factory=dict)
    body: Optional[Callable[[Dict[str, Any], Case], Dict[str, Any]]] = None  # host tweaks
    stream_only: bool = False
    trimmed_ok: bool = False  # the host strips surrounding whitespace of non-streamed replies
    log_notes: Optional[Callable[[str], List[str]]] = None  # server log segment -> notes per request
    # (model dir, distinct cases, max_tokens) -> per case name {"ok", "diffs", "prompt_tokens"} or {"error"}
    prompt_check: Optional[Callable[[Path, List["Case"], int], Dict[str, Dict[str, Any]]]] = None


@dataclass
class Result:
    phase: str
    name: str
    what: str
    expected: Optional[str] = None
    got: Optional[str] = None
    equal: str = "NO"
    error: Optional[str] = None
    finish_reason: Optional[str] = None
    prompt_tokens_host: Optional[int] = None
    prompt_tokens_ref: Optional[int] = None
    prompt_check: str = ""  # "same", "DIFFERS: ...", "error: ..." where the host has a prompt check
    seconds: float = 0.0
    notes: List[str] = field(default_factory=list)


def demo_image() -> str:
    from compass_compat.cli.generate import DEMO_IMAGE

    return str(DEMO_IMAGE)


def standard_cases() -> List[Case]:
    """The request set every host gets (oMLX: less g and h, plus its video request)."""
    demo = demo_image()
    return [
        Case("a", [demo], "Describe this picture.", "image + text"),
        Case("b", [], "Say hello.", "text only"),
        Case("c", [demo], "Describe this picture.", "= a, streamed", stream=True),
        Case(
            "d",
            [str(FIXTURES / "synth_448x448.png"), str(FIXTURES / "synth_320x256.png")],
            "Compare the two pictures.",
            "two images + text",
        ),
        Case("e", [demo], "Describe this picture.", "= a again (repeated picture)"),
        Case("g", [str(FIXTURES / "synth_320x256.png")], "What shape is in the middle?", "image + other text"),
        Case("h", [], "Say hello.", "= b again"),
        Case(
            "f1",
            [str(FIXTURES / "synth_501x379.png")],
            "What colours do you see in this picture?",
            "concurrent: image + text",
            group="concurrent",
        ),
        Case(
            "f2",
            [],
            "Write one sentence about the sea, the wind and the sky at night.",
            "concurrent: text only",
            group="concurrent",
        ),
        Case(
            "f3",
            [str(FIXTURES / "synth_256x320.png")],
            "Describe it.",
            "concurrent: image + short text",
            group="concurrent",
        ),
    ]


def long_text(words: int = 1250) -> str:
    """A long text prompt: about 2180 tokens on the toy's tokenizer, past a 2048-token prefill step and the 640-token window."""
    base = (
        "The sea was calm and the wind was low, and the sky over the harbour turned from blue to "
        "grey as the boats came home one by one. "
    )
    out, n = [], 0
    while n < words:
        out.append(base)
        n += len(base.split())
    return "".join(out) + "What did the boats do?"


# --------------------------------------------------------------------------- helpers
def log(host: str, msg: str) -> None:
    print(f"[{host}-e2e] {msg}", flush=True)


def console_script(name: str) -> List[str]:
    """argv that starts this environment's console script ``name`` (see the module docstring)."""
    return [sys.executable, str(Path(sys.executable).with_name(name))]


def lists_model(reply: Any) -> Optional[str]:
    """A ready_check: None once /v1/models lists MODEL_ID."""
    ids = [m.get("id") for m in (reply.get("data") or [])]
    return None if MODEL_ID in ids else f"/v1/models lists {ids}"


def export_rev(rev: str, out: Path) -> Path:
    """`git archive` of the SOURCES folders rev has into out/src-<sha> (reads objects only)."""

    def git(*args: str, **kw: Any) -> Any:
        return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, timeout=60, **kw)

    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}", text=True).stdout.strip()
    dest = out / f"src-{sha[:12]}"
    if not (dest / "compass_compat" / "__init__.py").is_file():
        tmp = out / f".src-{sha[:12]}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        present = [p for p in git("ls-tree", "--name-only", sha, text=True).stdout.split() if p in SOURCES]
        archive = git("archive", "--format=tar", sha, *present).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True, timeout=60)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest


def git_revision(folder: Path) -> str:
    """`<short sha> <date>` of the checkout's HEAD, plus a mark when its package folders differ."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30).stdout

    try:
        head = git("log", "-1", "--format=%h %cs").strip()
        dirty = git("status", "--porcelain", "--", *SOURCES).strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" + uncommitted changes" if dirty else "")


def versions(names: List[str]) -> Dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in [*names, "compass-compat"]:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "missing"
    return out


def upstream_ships_package() -> bool:
    """Whether the installed mlx-vlm has its own cohere_compass (then the vendored one is forced)."""
    from compass_compat import implementation_info

    return bool(implementation_info().upstream_available)


def data_uri(path: str, _cache: Dict[str, str] = {}) -> str:  # noqa: B006  (a deliberate memo)
    if path not in _cache:
        mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
        _cache[path] = f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return _cache[path]


def openai_body(case: Case, max_tokens: int, stream: bool) -> Dict[str, Any]:
    content: Any = case.text
    if case.images or case.dropped_videos:
        content = [{"type": "image_url", "image_url": {"url": data_uri(p)}} for p in case.images]
        content += [{"type": "video_url", "video_url": {"url": data_uri(p)}} for p in case.dropped_videos]
        content.append({"type": "text", "text": case.text})
    body: Dict[str, Any] = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# --------------------------------------------------------------------------- checkpoint, reference
def prepare_model_dir(out: Path) -> Path:
    from compass_data.toy import ensure_default_checkpoint

    src = ensure_default_checkpoint()
    if src.name != MODEL_ID:
        raise RuntimeError(f"the default checkpoint is now {src.name!r}: set MODEL_ID to it")
    dst = out / "models" / MODEL_ID
    shutil.rmtree(dst.parent, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def source_env(source: Optional[Path], extra: Dict[str, str]) -> Dict[str, str]:
    # No switch leaks in from the caller: the host runs as a user starts it, with the opt-in only.
    drop = (AUTOPATCH, "COMPASS_HOST_PROBE_DIR", FORCE, "COMPASS_COMPAT_IMPLEMENTATION")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(source), *filter(None, [env.get("PYTHONPATH")])])
    return env


def generate_argv(model_dir: Path, case: Case, max_tokens: int) -> List[str]:
    """The arguments of `python -m compass_compat` that answer ``case`` greedily."""
    argv = ["generate", "--model", str(model_dir), "--no-verbose", "--temperature", "0"]
    argv += ["--max-tokens", str(max_tokens)]
    argv += ["--image", *case.images] if case.images else ["--no-image"]
    return argv + ["--prompt", case.text]


def expected_text(
    model_dir: Path, case: Case, max_tokens: int, env: Dict[str, str]
) -> Tuple[Optional[str], Optional[str]]:
    """(text, error) from one `python -m compass_compat generate` process.

    It runs in the checkpoint's folder: `python -m` puts the working folder first on sys.path,
    and the checkout's root there would shadow a --source checkout.
    """
    argv = [sys.executable, "-m", "compass_compat", *generate_argv(model_dir, case, max_tokens)]
    try:
        proc = subprocess.run(argv, capture_output=True, env=env, timeout=300, cwd=str(model_dir.parent))
    except subprocess.TimeoutExpired:
        return None, "generate timed out after 300 s"
    if proc.returncode != 0:
        tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        return None, f"generate exited {proc.returncode}: {' | '.join(tail)}"
    text = proc.stdout.decode("utf-8")
    return (text[:-1] if text.endswith("\n") else text), None  # the CLI ends with one print()


# --------------------------------------------------------------------------- server
def http_get_json(url: str, headers: Dict[str, str], timeout: float) -> Any:
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def wait_ready(host: Host, server: Process, base_url: str, timeout: float) -> float:
    start = time.monotonic()
    last = ""
    while time.monotonic() - start < timeout:
        if not server.alive():
            raise RuntimeError(f"the server exited with {server.proc.returncode} before it was ready")
        try:
            reply = http_get_json(base_url + host.ready_path, host.headers, 3)
            problem = (host.ready_check or lists_model)(reply)
            if problem is None:
                return time.monotonic() - start
            last = problem
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as err:
            last = f"{type(err).__name__}: {err}"
        time.sleep(1.0)
    raise TimeoutError(f"the server was not ready after {timeout:.0f} s ({last})")


def post_chat(base_url: str, body: Dict[str, Any], headers: Dict[str, str], timeout: float) -> Dict[str, Any]:
    """One /v1/chat/completions call; returns text, finish_reason, prompt_tokens, error."""
    req = urllib.request.Request(
        base_url + "/v1/chat/completions",
        data=json.dumps(body).encode("utf-8"),
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    out: Dict[str, Any] = {"text": None, "finish_reason": None, "prompt_tokens": None, "error": None}
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if not body.get("stream"):
                reply = json.loads(resp.read())
                choice = reply["choices"][0]
                out["text"] = choice["message"].get("content") or ""
                out["finish_reason"] = choice.get("finish_reason")
                out["prompt_tokens"] = (reply.get("usage") or {}).get("prompt_tokens")
                return out
            parts: List[str] = []
            errors: List[str] = []
            done = False
            for raw in resp:  # server-sent events, one "data: ..." line each
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(payload)
                except ValueError:
                    errors.append(f"undecodable event {payload[:80]!r}")
                    continue
                if "error" in event:
                    errors.append(f"error event: {json.dumps(event['error'])[:300]}")
                    continue
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        parts.append(delta["content"])
                    if choice.get("finish_reason"):
                        out["finish_reason"] = choice["finish_reason"]
                if event.get("usage"):
                    out["prompt_tokens"] = event["usage"].get("prompt_tokens")
            out["text"] = "".join(parts)
            if errors:
                out["error"] = "; ".join(errors)
            elif not done:
                out["error"] = "stream ended without data: [DONE]"
            elif out["finish_reason"] is None:
                out["error"] = "stream ended without a finish_reason"
    except urllib.error.HTTPError as err:
        out["error"] = f"HTTP {err.code}: {err.read().decode('utf-8', 'replace')[:300]}"
    except Exception as err:  # reset, timeout, a body cut short, bad JSON, ...
        out["error"] = f"{type(err).__name__}: {err}"
    return out


def server_errors(segment: str) -> List[str]:
    """Error lines of the server log, exception lines ("AttributeError: ...") first."""
    lines = [ln.strip() for ln in segment.splitlines()]
    raised = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception): ", ln)]
    logged = [ln for ln in lines if any(k in ln for k in ("ERROR", "CRITICAL", "Traceback"))]
    return [ln[:300] for ln in raised + logged][:3]


# --------------------------------------------------------------------------- probe
def read_probes(probe_dir: Path, vendor_dir: Path) -> Tuple[bool, str, List[Dict[str, Any]]]:
    """(ok, one-line verdict, records): is the vendored package the live one in the host?"""
    records = []
    for path in sorted(
        p for p in probe_dir.glob("probe-*.json") if not p.name.endswith(("-exit.json", "-vision.json"))
    ):
        with contextlib.suppress(ValueError, OSError):
            records.append(json.loads(path.read_text(encoding="utf-8")))
    if not records:
        return False, "no host process imported mlx_vlm.models.cohere_compass (probe silent)", records
    bad = []
    for r in records:
        info = r.get("info") or {}
        live = Path(r.get("live_file") or "/nonexistent").resolve()
        inside = vendor_dir in live.parents
        if r.get("error") or info.get("implementation") != "vendored" or not inside:
            bad.append(
                f"pid {r['pid']}: {info.get('implementation', r.get('error'))} from {r.get('live_file')} "
                f"({info.get('reason')})"
            )
    if bad:
        return False, "NOT the vendored package: " + "; ".join(bad), records
    pids = ", ".join(str(r["pid"]) for r in records)
    return True, f"vendored package live in host pid {pids} ({records[0].get('info', {}).get('reason')})", records


def vision_caches(probe_dir: Path) -> str:
    """What the host processes' vision work came to ("" if none): tower runs, cache traffic, entries at exit.

    Tower runs are calls of the live Model.encode_image (grids of the pictures encoded); cache
    traffic is every mlx-vlm VisionFeatureCache.get (hit / miss) and put, counted by the probe.
    """
    parts = []
    records: Dict[str, Dict[str, Any]] = {}
    for kind in ("vision", "exit"):  # the exit record (when written) is the later one
        for path in sorted(probe_dir.glob(f"probe-*-{kind}.json")):
            with contextlib.suppress(ValueError, OSError):
                r = json.loads(path.read_text(encoding="utf-8"))
                records[str(r["pid"])] = {**records.get(str(r["pid"]), {}), **r}
    for r in records.values():
        runs = r.get("tower_runs") or []
        gets = r.get("cache_get_hit", 0) + r.get("cache_get_miss", 0)
        sizes = r.get("vision_feature_cache_entries") or []
        if not (runs or gets or sizes):
            continue
        at_exit = (
            f"at exit {len(sizes)} caches, entries {sizes}" if "vision_feature_cache_entries" in r else "no exit record"
        )
        part = f"pid {r['pid']}: tower ran {len(runs)} times"
        if runs:
            part += " (grids " + ", ".join(json.dumps(g) for g in runs) + ")"
        part += (
            f"; VisionFeatureCache get {gets} ({r.get('cache_get_hit', 0)} hits), put {r.get('cache_put', 0)}"
            f" (entries after each put {r.get('entries_after_put') or []}); {at_exit}"
        )
        parts.append(part)
    return "; ".join(parts)


# --------------------------------------------------------------------------- table
def show(text: Optional[str], width: int) -> str:
    if text is None:
        return "-"
    s = json.dumps(text, ensure_ascii=False)[1:-1]
    return s if len(s) <= width else s[: width - 3] + "..."


def judge(r: Result, trimmed_ok: bool) -> None:
    if r.error or r.got is None or r.expected is None:
        r.equal = "NO"
    elif r.got == r.expected:
        r.equal = "yes"
    elif trimmed_ok and r.got.strip() == r.expected.strip():
        r.equal = "yes, trimmed"
    else:
        r.equal = "NO"
        n = next((i for i, (x, y) in enumerate(zip(r.got, r.expected)) if x != y), min(len(r.got), len(r.expected)))
        r.notes.append(f"differs from char {n}")


def table_rows(host: Host, results: List[Result], width: int) -> List[Tuple[str, ...]]:
    rows = [("host", "request", "expected", "got", "equal", "notes")]
    for r in results:
        notes = ([f"ERROR {r.error}"] if r.error else []) + r.notes
        notes = [" ".join(n.split())[:160] for n in notes]
        rows.append(
            (
                host.name,
                f"{r.phase}/{r.name} {r.what}",
                show(r.expected, width),
                show(r.got, width),
                r.equal,
                "; ".join(notes),
            )
        )
    return rows


def print_table(rows: List[Tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for i, row in enumerate(rows):
        print(" | ".join(c.ljust(widths[j]) if j < 5 else c for j, c in enumerate(row)).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths) + "-+-" + "-" * 5)


def write_report(out: Path, record: Dict[str, Any], phase_lines: List[str], rows: List[tuple]) -> None:
    """``out``/results.json (``record``) and ``out``/table.md: the record's summary line, versions,
    ``phase_lines``, then the table ``rows``."""
    (out / "results.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    md = [f"{record['host']}: {record['summary']} ({record['seconds']} s); compass-compat {record['revision']}", ""]
    md += ["- versions: " + ", ".join(f"{k} {v}" for k, v in record["versions"].items())]
    (out / "table.md").write_text("\n".join(md + phase_lines) + "\n\n" + markdown_table(rows), encoding="utf-8")


def markdown_table(rows: List[Tuple[str, ...]]) -> str:
    def cell(s: str) -> str:
        return s.replace("|", "\\|")

    out = ["| " + " | ".join(rows[0]) + " |", "|" + " --- |" * len(rows[0])]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows[1:]]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- run
def run_phase(
    host: Host,
    phase: Phase,
    model_dir: Path,
    out: Path,
    results: Dict[Tuple[str, str], Result],
    args: argparse.Namespace,
    env: Dict[str, str],
    vendor_dir: Path,
) -> Dict[str, Any]:
    port = free_port()
    probe_dir = out / f"probe-{phase.name}"
    shutil.rmtree(probe_dir, ignore_errors=True)
    probe_dir.mkdir(parents=True)
    penv = dict(env, **host.env, **phase.env, COMPASS_HOST_PROBE_DIR=str(probe_dir))
    penv[AUTOPATCH] = "1"
    penv["PYTHONPATH"] = os.pathsep.join([*filter(None, [penv.get("PYTHONPATH")]), str(PROBE_DIR)])
    argv = host.command(model_dir, port) + phase.args + args.server_args.split()
    opt_in = " ".join(f"{k}={penv[k]}" for k in (AUTOPATCH, FORCE) if penv.get(k))
    # A throw-away key is still not worth printing; paths relative to the checkout.
    shown = {k: ("<random>" if k.endswith("_KEY") else v) for k, v in {**host.env, **phase.env}.items()}
    extra_env = " ".join(f"{k}={v}" for k, v in shown.items())
    command = " ".join(filter(None, [opt_in, extra_env, *argv])).replace(str(ROOT) + "/", "")
    log(host.name, f"phase {phase.name}: {command}")
    server: Optional[Process] = None
    base_url = f"http://127.0.0.1:{port}"
    phase_info: Dict[str, Any] = {"command": command, "note": phase.note}
    mine = [results[(phase.name, c.name)] for c in phase.cases]

    def fail_all(reason: str) -> None:
        for r in mine:
            if r.got is None and not r.error:
                r.error = reason

    try:
        server = Process(argv, out / f"serve-{phase.name}.log", penv, out)
        phase_info["ready_seconds"] = round(wait_ready(host, server, base_url, args.ready_timeout), 1)
        log(host.name, f"ready after {phase_info['ready_seconds']} s on {base_url}")

        def send(case: Case) -> Dict[str, Any]:
            stream = True if host.stream_only else case.stream
            body = openai_body(case, args.max_tokens, stream)
            if host.body:
                body = host.body(body, case)
            t0 = time.monotonic()
            reply = post_chat(base_url, body, host.headers, args.request_timeout)
            reply["seconds"] = time.monotonic() - t0
            return reply

        def absorb(r: Result, reply: Dict[str, Any], segment: str) -> None:
            r.got, r.finish_reason = reply.get("text"), reply.get("finish_reason")
            r.prompt_tokens_host, r.seconds = reply.get("prompt_tokens"), round(reply["seconds"], 1)
            if reply.get("error"):
                r.error = (r.error + "; " if r.error else "") + reply["error"]
            elif r.finish_reason not in ("length", "stop"):
                r.notes.append(f"finish_reason {r.finish_reason}")
            if host.log_notes:
                r.notes.extend(host.log_notes(segment))
            errs = server_errors(segment)
            if errs and (r.error or r.got != r.expected):
                r.notes.append(f"server log: {errs[0]}")

        for case in [c for c in phase.cases if c.group == "sequential"]:
            r = results[(phase.name, case.name)]
            if not server.alive():
                r.error = "server is gone"
                continue
            offset = server.log_size()
            reply = send(case)
            time.sleep(0.3)  # let the log catch up
            absorb(r, reply, server.log_since(offset))
            log(host.name, f"{phase.name}/{case.name}: {r.seconds} s, finish={r.finish_reason}, error={r.error}")
        group = [c for c in phase.cases if c.group == "concurrent"]
        if group and server.alive():
            offset = server.log_size()
            barrier = threading.Barrier(len(group))

            def at_once(case: Case) -> Dict[str, Any]:
                barrier.wait(timeout=30)
                return send(case)

            with ThreadPoolExecutor(len(group)) as pool:
                replies = list(pool.map(at_once, group))
            time.sleep(0.3)
            segment = server.log_since(offset)
            for case, reply in zip(group, replies):
                r = results[(phase.name, case.name)]
                absorb(r, reply, segment)
                log(host.name, f"{phase.name}/{case.name}: {r.seconds} s, finish={r.finish_reason}, error={r.error}")
        if not server.alive():
            log(host.name, f"the server died (exit {server.proc.returncode}); see {server.log_path}")
            fail_all("server is gone")
    except (KeyboardInterrupt, TimeoutError, RuntimeError) as err:
        log(host.name, f"phase {phase.name} aborted: {type(err).__name__}: {err}")
        fail_all(f"not sent ({type(err).__name__}: {err})")
    finally:
        if server is not None:
            phase_info["server_exit"] = server.stop()
            log(host.name, f"server stopped (exit {phase_info['server_exit']}); log: {server.log_path}")

    ok, verdict, records = read_probes(probe_dir, vendor_dir)
    phase_info.update(probe_ok=ok, probe=verdict, probe_records=records)
    log(host.name, f"probe ({phase.name}): {verdict}")
    caches = vision_caches(probe_dir)
    if caches:
        phase_info["vision_cache"] = caches
        log(host.name, f"vision cache ({phase.name}): {caches}")
    if not ok:
        for r in mine:
            r.notes.append("probe: " + verdict)
    return phase_info


def main(host: Host, argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=f"{host.label} end to end (scripts/hosts/common/e2e.py)")
    ap.add_argument("--max-tokens", type=int, default=12, help="for every request (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "hosts" / host.name, help="work folder")
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for the server to come up")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds per HTTP request")
    ap.add_argument("--phase", action="append", help="run only these phases (repeatable)")
    ap.add_argument("--source", type=Path, help="checkout whose compass_compat/vendor to run (first on PYTHONPATH)")
    ap.add_argument(
        "--git-rev", help="run compass-compat as committed at this revision (e.g. HEAD): --source of its export"
    )
    ap.add_argument("--no-prompt-check", action="store_true", help="skip the host's in-process prompt check")
    ap.add_argument("--width", type=int, default=40, help="table column width for texts")
    ap.add_argument(
        "--server-args", default="", help="extra server arguments for every phase, one string (e.g. a host flag to try)"
    )
    args = ap.parse_args(argv)

    source = args.source.resolve() if args.source else None
    if args.git_rev:
        source = export_rev(args.git_rev, args.out.resolve())
    if source is not None:
        sys.path.insert(0, str(source))
    try:
        import compass_compat  # noqa: F401
        import compass_data  # noqa: F401
    except ImportError as err:
        print(
            f"{host.name} e2e: compass-compat is not importable here ({err}); use the host environment", file=sys.stderr
        )
        return 2
    from compass_compat.vendor import vendor_root

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    vers = versions(host.distributions)
    upstream = upstream_ships_package()
    env = source_env(source, {})
    vendor_dir = vendor_root().resolve()
    log(host.name, "versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()))
    revision = git_revision(Path(compass_compat.__file__).resolve().parent.parent)
    log(
        host.name,
        f"compass_compat from {Path(compass_compat.__file__).parent} ({revision}); vendored tree {vendor_dir}",
    )
    log(host.name, f"mlx-vlm ships cohere_compass: {upstream} (no flag set: the recorded verdicts decide)")
    phases = [p for p in host.phases() if not args.phase or p.name in args.phase]
    model_dir = prepare_model_dir(out)
    log(host.name, f"checkpoint {model_dir}")

    results: Dict[Tuple[str, str], Result] = {}
    distinct: Dict[Tuple, Case] = {}
    for p in phases:
        for c in p.cases:
            results[(p.name, c.name)] = Result(p.name, c.name, c.what)
            distinct.setdefault(c.key(), c)
    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:  # two at a time: the machine is small
        answers = dict(
            zip(distinct, pool.map(lambda c: expected_text(model_dir, c, args.max_tokens, env), distinct.values()))
        )
    for p in phases:
        for c in p.cases:
            text, err = answers[c.key()]
            results[(p.name, c.name)].expected = text
            if err:
                results[(p.name, c.name)].error = f"reference: {err}"
    log(host.name, f"expected answers: {len(distinct)} generate processes in {time.monotonic() - t0:.1f} s")
    checks = {}
    if host.prompt_check and not args.no_prompt_check:
        t0 = time.monotonic()
        checks = host.prompt_check(model_dir, list(distinct.values()), args.max_tokens)
        by_key = {c.key(): checks[c.name] for c in distinct.values()}
        for p in phases:
            for c in p.cases:
                entry, r = by_key[c.key()], results[(p.name, c.name)]
                r.prompt_tokens_ref = entry.get("prompt_tokens")
                if entry.get("error"):
                    r.prompt_check = "error: " + entry["error"]
                else:
                    r.prompt_check = "same" if entry["ok"] else "DIFFERS: " + ", ".join(entry["diffs"])
        verdicts = ", ".join(f"{n} {'same' if e.get('ok') else 'NOT same'}" for n, e in checks.items())
        log(host.name, f"prompt check ({time.monotonic() - t0:.1f} s): {verdicts}")

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")  # run_phase stops the server on the way out

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        phase_info = {p.name: run_phase(host, p, model_dir, out, results, args, env, vendor_dir) for p in phases}
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    ordered = [results[(p.name, c.name)] for p in phases for c in p.cases]
    for r in ordered:
        judge(r, host.trimmed_ok)
        if not phase_info[r.phase]["probe_ok"]:
            r.equal = "NO"
        if r.prompt_tokens_host not in (None, r.prompt_tokens_ref) and r.prompt_tokens_ref is not None:
            r.notes.append(f"prompt tokens host {r.prompt_tokens_host} vs ref {r.prompt_tokens_ref}")
        if r.prompt_check not in ("", "same"):
            r.notes.append(f"prompt check {r.prompt_check}")
            r.equal = "NO"
    rows = table_rows(host, ordered, args.width)
    print()
    print_table(rows)
    bad = [f"{r.phase}/{r.name}" for r in ordered if r.equal == "NO"]
    seconds = round(time.monotonic() - started, 1)
    summary = f"{host.name}: {len(ordered) - len(bad)} of {len(ordered)} requests equal" + (
        f"; differing: {', '.join(bad)}" if bad else ""
    )
    record = {
        "host": host.label,
        "versions": vers,
        "upstream_ships": upstream,
        "compass_compat": str(Path(compass_compat.__file__).parent),
        "revision": revision,
        "max_tokens": args.max_tokens,
        "seconds": seconds,
        "phases": phase_info,
        "prompt_check": checks,
        "results": [asdict(r) for r in ordered],
        "failed": bad,
        "summary": summary,
    }
    phase_lines = []
    for n, i in phase_info.items():
        phase_lines.append(f"- phase `{n}`: `{i['command']}`; probe: {i['probe']}")
        if i.get("vision_cache"):
            phase_lines.append(f"  - vision work: {i['vision_cache']}")
    write_report(out, record, phase_lines, rows)
    print()
    log(host.name, f"{summary} in {seconds} s; details {out / 'results.json'}")
    return 1 if bad else 0
