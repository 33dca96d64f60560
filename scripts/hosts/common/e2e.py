"""The host end-to-end driver. A host script (scripts/hosts/<host>/e2e.py) describes its host as a
:class:`Host` and calls :func:`main`, which:

1. copies the default checkpoint (as `python -m compass_compat generate` finds it) to OUT/models;
2. answers every distinct request with one `python -m compass_compat generate --temperature 0`
   process each (fresh processes: nothing carries over between requests);
3. runs the host's in-process prompt check where it has one (what the host's prompt pipeline hands
   mlx-vlm against what the CLI hands it); a request whose inputs differ fails;
4. for every phase starts the host's server with the opt-in alone (COMPASS_COMPAT_AUTOPATCH=1: the
   recorded verdicts decide which cohere_compass is live) and the probe (scripts/hosts/common/probe)
   on its PYTHONPATH, sends the phase's requests (greedy; the sequential ones in order, then the
   concurrent group at once) and always stops the server; unless the probe saw the vendored package
   live inside the host, every request of the phase fails;
5. prints `host | request | expected | got | equal`, writes OUT/results.json and OUT/table.md and
   exits 1 on any difference (2 when compass-compat is not importable).

`--source DIR` runs another checkout's packages (DIR first on PYTHONPATH of the reference processes
and the server); `--git-rev REV` runs REV's, exported with `git archive` to OUT/src-<sha>. Host
executables start as `python <console script>` of this interpreter: a moved environment keeps its
scripts' old `#!` lines.
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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from tests.support.server import Process, free_port

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "images"
PROBE_DIR = Path(__file__).resolve().parent / "probe"
MODEL_ID = "toy-shapes-v5"  # compass_data.toy.DEFAULT_CHECKPOINT; checked in prepare_model_dir
AUTOPATCH = "COMPASS_COMPAT_AUTOPATCH"
# No switch leaks in from the caller: the host runs as a user starts it, with the opt-in only.
SWITCHES = (AUTOPATCH, "COMPASS_COMPAT_FORCE_VENDORED", "COMPASS_COMPAT_IMPLEMENTATION", "COMPASS_COMPAT_MLX_LM")
SOURCES = ("compass_compat", "compass_data", "vendor")  # what --git-rev exports
TIMEOUT = 300.0  # seconds for a server to come up, for a request, for a reference answer
WIDTH = 40  # table column width for texts


@dataclass
class Case:
    """One chat request: a single user turn, image parts first, then video parts, then one text part."""

    name: str
    images: List[str]
    text: str
    what: str
    stream: bool = False
    group: str = "sequential"  # or "concurrent"
    # Sent as video_url parts to a host documented to drop them: the reference is the request without them.
    dropped_videos: List[str] = field(default_factory=list)

    def key(self) -> Tuple[Tuple[str, ...], str, Tuple[str, ...]]:
        return tuple(self.images), self.text, tuple(self.dropped_videos)


@dataclass
class Phase:
    """One server start: its extra arguments and the requests sent to it."""

    name: str
    cases: List[Case]
    args: List[str] = field(default_factory=list)
    note: str = ""


@dataclass
class Host:
    """What a host run needs to know about the host."""

    name: str  # e.g. "lmstudio"
    label: str  # e.g. "LM Studio's engine (mlx-engine 08f0c07)"
    distributions: List[str]  # reported versions
    command: Callable[[Path, int], List[str]]  # (model dir, port) -> argv
    # Built after --source is on sys.path: the request set names files of the package it tests.
    phases: Callable[[], List[Phase]] = list
    ready_path: str = "/v1/models"  # GET path that answers 200 once the model is loaded
    ready_check: Optional[Callable[[Any], Optional[str]]] = None  # JSON -> error or None (default: lists_model)
    headers: Dict[str, str] = field(default_factory=dict)
    env: Dict[str, str] = field(default_factory=dict)
    body: Optional[Callable[[Dict[str, Any], Case], Dict[str, Any]]] = None  # host tweaks
    stream_only: bool = False
    trimmed_ok: bool = False  # the host strips surrounding whitespace of non-streamed replies
    log_notes: Optional[Callable[[str], List[str]]] = None  # server log segment -> notes per request
    # (model dir, distinct cases, max_tokens) -> per case name {"ok", "diffs", "prompt_tokens"} or {"error"}
    prompt_check: Optional[Callable[[Path, List[Case], int], Dict[str, Dict[str, Any]]]] = None


@dataclass
class Result:
    phase: str
    name: str
    what: str
    equal: str = "NO"
    expected: Optional[str] = None
    got: Optional[str] = None
    error: Optional[str] = None
    finish_reason: Optional[str] = None
    prompt_tokens_host: Optional[int] = None
    prompt_tokens_ref: Optional[int] = None
    prompt_check: str = ""  # "same", "DIFFERS: ...", "error: ..." where the host has a prompt check
    seconds: float = 0.0
    notes: List[str] = field(default_factory=list)


@dataclass
class Run:
    """What every host run sets up before its first server: options, folders, environment, checkpoint."""

    host: Host
    max_tokens: int
    out: Path
    env: Dict[str, str]  # of the reference processes and the servers
    vendor_dir: Path
    versions: Dict[str, str]
    upstream_ships: bool
    revision: str
    model_dir: Path
    started: float = field(default_factory=time.monotonic)


def standard_cases() -> List[Case]:
    """The request set every host gets (oMLX: less g and h, plus its video request)."""
    from compass_compat.cli.generate import DEMO_IMAGE

    demo = str(DEMO_IMAGE)
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


def log(host: str, msg: str) -> None:
    print(f"[{host}-e2e] {msg}", flush=True)


def console_script(name: str) -> List[str]:
    """argv that starts this environment's console script ``name`` (see the module docstring)."""
    return [sys.executable, str(Path(sys.executable).with_name(name))]


def lists_model(reply: Any) -> Optional[str]:
    """The default ready_check: None once /v1/models lists MODEL_ID."""
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


def data_uri(path: str, _cache: Dict[str, str] = {}) -> str:  # noqa: B006  (a deliberate memo)
    if path not in _cache:
        mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
        _cache[path] = f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return _cache[path]


def chat_body(model: str, content: Any, max_tokens: int, stream: bool = False) -> Dict[str, Any]:
    """A greedy /v1/chat/completions body: one user turn."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return dict(body, temperature=0, stream=stream)


def openai_body(case: Case, max_tokens: int, stream: bool) -> Dict[str, Any]:
    content: Any = case.text
    if case.images or case.dropped_videos:
        content = [{"type": "image_url", "image_url": {"url": data_uri(p)}} for p in case.images]
        content += [{"type": "video_url", "video_url": {"url": data_uri(p)}} for p in case.dropped_videos]
        content.append({"type": "text", "text": case.text})
    body = chat_body(MODEL_ID, content, max_tokens, stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# --------------------------------------------------------------------------- setup, reference
def setup(host: Host, argv: Optional[List[str]]) -> Optional[Run]:
    """Parse the options, import compass-compat (from --source / --git-rev first), copy the checkpoint.
    None when compass-compat is not importable here."""
    ap = argparse.ArgumentParser(description=f"{host.label} end to end (scripts/hosts/common/e2e.py)")
    ap.add_argument("--max-tokens", type=int, default=12, help="for every request (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "hosts" / host.name, help="work folder")
    ap.add_argument("--source", type=Path, help="checkout whose compass_compat/vendor to run (first on PYTHONPATH)")
    ap.add_argument(
        "--git-rev", help="run compass-compat as committed at this revision (e.g. HEAD): --source of its export"
    )
    args = ap.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    source = export_rev(args.git_rev, out) if args.git_rev else args.source.resolve() if args.source else None
    if source is not None:
        sys.path.insert(0, str(source))
    try:
        import compass_compat
        from compass_compat.vendor import vendor_root
        from compass_data.toy import ensure_default_checkpoint
    except ImportError as err:
        print(
            f"{host.name} e2e: compass-compat is not importable here ({err}); use the host environment", file=sys.stderr
        )
        return None

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")  # run_phase stops the server on the way out

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(source), *filter(None, [env.get("PYTHONPATH")])])
    src = ensure_default_checkpoint()
    if src.name != MODEL_ID:
        raise RuntimeError(f"the default checkpoint is now {src.name!r}: set MODEL_ID to it")
    model_dir = out / "models" / MODEL_ID
    shutil.rmtree(model_dir.parent, ignore_errors=True)
    shutil.copytree(src, model_dir)
    package = Path(compass_compat.__file__).resolve().parent
    run = Run(
        host=host,
        max_tokens=args.max_tokens,
        out=out,
        env=env,
        vendor_dir=vendor_root().resolve(),
        versions=versions(host.distributions),
        upstream_ships=bool(compass_compat.implementation_info().upstream_available),
        revision=git_revision(package.parent),
        model_dir=model_dir,
    )
    log(host.name, "versions: " + ", ".join(f"{k} {v}" for k, v in run.versions.items()))
    log(host.name, f"compass_compat from {package} ({run.revision}); vendored tree {run.vendor_dir}")
    log(host.name, f"mlx-vlm ships cohere_compass: {run.upstream_ships} (no flag set: the recorded verdicts decide)")
    log(host.name, f"checkpoint {model_dir}")
    return run


def generate_argv(model_dir: Path, case: Case, max_tokens: int) -> List[str]:
    """The arguments of `python -m compass_compat` that answer ``case`` greedily."""
    argv = ["generate", "--model", str(model_dir), "--no-verbose", "--temperature", "0"]
    argv += ["--max-tokens", str(max_tokens)]
    argv += ["--image", *case.images] if case.images else ["--no-image"]
    return argv + ["--prompt", case.text]


def distinct(cases: List[Case]) -> Dict[Tuple, Case]:
    """The first case of every distinct request, by key, in order."""
    out: Dict[Tuple, Case] = {}
    for c in cases:
        out.setdefault(c.key(), c)
    return out


def references(run: Run, cases: List[Case]) -> Dict[Tuple, Tuple[Optional[str], Optional[str]]]:
    """Per distinct case key, (text, error) from one `python -m compass_compat generate` process.

    They run in the checkpoint's folder: `python -m` puts the working folder first on sys.path,
    and the checkout's root there would shadow a --source checkout.
    """

    def answer(case: Case) -> Tuple[Optional[str], Optional[str]]:
        argv = [sys.executable, "-m", "compass_compat", *generate_argv(run.model_dir, case, run.max_tokens)]
        try:
            proc = subprocess.run(argv, capture_output=True, env=run.env, timeout=TIMEOUT, cwd=str(run.out / "models"))
        except subprocess.TimeoutExpired:
            return None, f"generate timed out after {TIMEOUT:.0f} s"
        if proc.returncode != 0:
            tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
            return None, f"generate exited {proc.returncode}: {' | '.join(tail)}"
        text = proc.stdout.decode("utf-8")
        return (text[:-1] if text.endswith("\n") else text), None  # the CLI ends with one print()

    unique = distinct(cases)
    with ThreadPoolExecutor(2) as pool:  # two at a time: the machine is small
        return dict(zip(unique, pool.map(answer, unique.values())))


# --------------------------------------------------------------------------- server
def wait_ready(host: Host, server: Process, base_url: str) -> float:
    start = time.monotonic()
    last = ""
    while time.monotonic() - start < TIMEOUT:
        if not server.alive():
            raise RuntimeError(f"the server exited with {server.proc.returncode} before it was ready")
        try:
            req = urllib.request.Request(base_url + host.ready_path, headers=host.headers)
            with urllib.request.urlopen(req, timeout=3) as resp:
                problem = (host.ready_check or lists_model)(json.load(resp))
            if problem is None:
                return time.monotonic() - start
            last = problem
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as err:
            last = f"{type(err).__name__}: {err}"
        time.sleep(1.0)
    raise TimeoutError(f"the server was not ready after {TIMEOUT:.0f} s ({last})")


def post_chat(base_url: str, body: Dict[str, Any], headers: Dict[str, str]) -> Dict[str, Any]:
    """One /v1/chat/completions call; returns text, finish_reason, prompt_tokens, cached_tokens, error."""
    req = urllib.request.Request(
        base_url + "/v1/chat/completions",
        data=json.dumps(body).encode("utf-8"),
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    out: Dict[str, Any] = {"text": None, "finish_reason": None, "prompt_tokens": None, "error": None}
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
            if not body.get("stream"):
                reply = json.loads(resp.read())
                choice, usage = reply["choices"][0], reply.get("usage") or {}
                out["text"] = choice["message"].get("content") or ""
                out["finish_reason"] = choice.get("finish_reason")
                out["prompt_tokens"] = usage.get("prompt_tokens")
                out["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
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


def run_phase(
    run: Run,
    name: str,
    steps: Callable[[Process, str], None],
    args: Sequence[str] = (),
    env: Optional[Dict[str, str]] = None,
    opted_in: bool = True,
) -> Dict[str, Any]:
    """Start the host's server for one phase (the opt-in unless ``opted_in`` is False, the probe on
    its PYTHONPATH), run ``steps(server, base_url)``, always stop it. Returns the phase's record:
    its command, "aborted" (why the requests did not all go out), the probe's verdict, the vision work."""
    host, port, extra = run.host, free_port(), {**run.host.env, **(env or {})}
    probe_dir = run.out / f"probe-{name}"
    shutil.rmtree(probe_dir, ignore_errors=True)
    probe_dir.mkdir(parents=True)
    penv = dict(run.env, **extra, COMPASS_HOST_PROBE_DIR=str(probe_dir))
    if opted_in:
        penv[AUTOPATCH] = "1"
    penv["PYTHONPATH"] = os.pathsep.join([*filter(None, [penv.get("PYTHONPATH")]), str(PROBE_DIR)])
    argv = host.command(run.model_dir, port) + list(args)
    # A throw-away key is still not worth printing; paths relative to the checkout.
    shown = [f"{k}={'<random>' if k.endswith('_KEY') else v}" for k, v in extra.items()]
    command = " ".join([f"{AUTOPATCH}=1"] * opted_in + shown + argv).replace(str(ROOT) + "/", "")
    log(host.name, f"phase {name}: {command}")
    info: Dict[str, Any] = {"command": command}
    server: Optional[Process] = None
    try:
        server = Process(argv, run.out / f"serve-{name}.log", penv, run.out)
        base_url = f"http://127.0.0.1:{port}"
        info["ready_seconds"] = round(wait_ready(host, server, base_url), 1)
        log(host.name, f"ready after {info['ready_seconds']} s on {base_url}")
        steps(server, base_url)
        if not server.alive():
            log(host.name, f"the server died (exit {server.proc.returncode}); see {server.log_path}")
            info["aborted"] = "server is gone"
    except (KeyboardInterrupt, TimeoutError, RuntimeError) as err:
        log(host.name, f"phase {name} aborted: {type(err).__name__}: {err}")
        info["aborted"] = f"not sent ({type(err).__name__}: {err})"
    finally:
        if server is not None:
            info["server_exit"] = server.stop()
            log(host.name, f"server stopped (exit {info['server_exit']}); log: {server.log_path}")
    ok, verdict, records = read_probes(probe_dir, run.vendor_dir)
    info.update(probe_ok=ok, probe=verdict, probe_records=records)
    log(host.name, f"probe ({name}): {verdict}")
    caches = vision_caches(probe_dir)
    if caches:
        info["vision_cache"] = caches
        log(host.name, f"vision cache ({name}): {caches}")
    return info


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
        if r.get("error") or info.get("implementation") != "vendored" or vendor_dir not in live.parents:
            what = info.get("implementation", r.get("error"))
            bad.append(f"pid {r['pid']}: {what} from {r.get('live_file')} ({info.get('reason')})")
    if bad:
        return False, "NOT the vendored package: " + "; ".join(bad), records
    pids = ", ".join(str(r["pid"]) for r in records)
    return True, f"vendored package live in host pid {pids} ({records[0].get('info', {}).get('reason')})", records


def vision_caches(probe_dir: Path) -> str:
    """The host processes' vision work ("" if none): tower runs (calls of the live Model.encode_image,
    with the pictures' grids), VisionFeatureCache gets (hit / miss) and puts, entries at exit."""
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


# --------------------------------------------------------------------------- table, report
def show(text: Optional[str]) -> str:
    if text is None:
        return "-"
    s = json.dumps(text, ensure_ascii=False)[1:-1]
    return s if len(s) <= WIDTH else s[: WIDTH - 3] + "..."


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


def finish(
    run: Run,
    phases: Dict[str, Dict[str, Any]],
    rows: List[Tuple[str, ...]],
    bad: List[str],
    summary: str,
    **record: Any,
) -> int:
    """Print the table, write OUT/results.json (``record`` added) and OUT/table.md; 1 if anything is ``bad``."""
    print()
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for i, row in enumerate(rows):
        print(" | ".join(c.ljust(widths[j]) if j < 5 else c for j, c in enumerate(row)).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths) + "-+-" + "-" * 5)
    seconds = round(time.monotonic() - run.started, 1)
    package = Path(sys.modules["compass_compat"].__file__).parent
    record = {
        "host": run.host.label,
        "versions": run.versions,
        "upstream_ships": run.upstream_ships,
        "compass_compat": str(package),
        "revision": run.revision,
        "max_tokens": run.max_tokens,
        "seconds": seconds,
        "phases": phases,
        **record,
        "failed": bad,
        "summary": summary,
    }
    (run.out / "results.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    md = [f"{run.host.label}: {summary} ({seconds} s); compass-compat {run.revision}", ""]
    md.append("- versions: " + ", ".join(f"{k} {v}" for k, v in run.versions.items()))
    for n, i in phases.items():
        md.append(f"- phase `{n}`: `{i['command']}`; probe: {i['probe']}")
        if i.get("vision_cache"):
            md.append(f"  - vision work: {i['vision_cache']}")
    md += ["", "| " + " | ".join(rows[0]) + " |", "|" + " --- |" * len(rows[0])]
    md += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows[1:]]
    (run.out / "table.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print()
    log(run.host.name, f"{summary} in {seconds} s; details {run.out / 'results.json'}")
    return 1 if bad else 0


# --------------------------------------------------------------------------- run
def send_phase(run: Run, phase: Phase, results: Dict[Tuple[str, str], Result]) -> Dict[str, Any]:
    """One phase of a standard run: its requests in order, then its concurrent group at once."""
    host = run.host

    def steps(server: Process, base_url: str) -> None:
        def send(case: Case) -> Dict[str, Any]:
            body = openai_body(case, run.max_tokens, host.stream_only or case.stream)
            t0 = time.monotonic()
            reply = post_chat(base_url, host.body(body, case) if host.body else body, host.headers)
            reply["seconds"] = time.monotonic() - t0
            return reply

        def absorb(case: Case, reply: Dict[str, Any], segment: str) -> None:
            r = results[(phase.name, case.name)]
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
            log(host.name, f"{phase.name}/{case.name}: {r.seconds} s, finish={r.finish_reason}, error={r.error}")

        for case in [c for c in phase.cases if c.group == "sequential"]:
            if not server.alive():
                results[(phase.name, case.name)].error = "server is gone"
                continue
            offset = server.log_size()
            reply = send(case)
            time.sleep(0.3)  # let the log catch up
            absorb(case, reply, server.log_since(offset))
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
                absorb(case, reply, segment)

    info = dict(run_phase(run, phase.name, steps, phase.args), note=phase.note)
    for c in phase.cases:
        r = results[(phase.name, c.name)]
        if info.get("aborted") and r.got is None and not r.error:
            r.error = info["aborted"]
        if not info["probe_ok"]:
            r.notes.append("probe: " + info["probe"])
    return info


def main(host: Host, argv: Optional[List[str]] = None) -> int:
    run = setup(host, argv)
    if run is None:
        return 2
    phases = host.phases()
    cases = [c for p in phases for c in p.cases]
    results = {(p.name, c.name): Result(p.name, c.name, c.what) for p in phases for c in p.cases}
    t0 = time.monotonic()
    answers = references(run, cases)
    for p in phases:
        for c in p.cases:
            text, err = answers[c.key()]
            results[(p.name, c.name)].expected = text
            if err:
                results[(p.name, c.name)].error = f"reference: {err}"
    log(host.name, f"expected answers: {len(answers)} generate processes in {time.monotonic() - t0:.1f} s")
    checks: Dict[str, Dict[str, Any]] = {}
    if host.prompt_check:
        t0 = time.monotonic()
        unique = distinct(cases)
        checks = host.prompt_check(run.model_dir, list(unique.values()), run.max_tokens)
        by_key = {k: checks[c.name] for k, c in unique.items()}
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

    phase_info = {p.name: send_phase(run, p, results) for p in phases}
    ordered = [results[(p.name, c.name)] for p in phases for c in p.cases]
    rows = [("host", "request", "expected", "got", "equal", "notes")]
    for r in ordered:
        judge(r, host.trimmed_ok)
        if not phase_info[r.phase]["probe_ok"]:
            r.equal = "NO"
        if r.prompt_tokens_host not in (None, r.prompt_tokens_ref) and r.prompt_tokens_ref is not None:
            r.notes.append(f"prompt tokens host {r.prompt_tokens_host} vs ref {r.prompt_tokens_ref}")
        if r.prompt_check not in ("", "same"):
            r.notes.append(f"prompt check {r.prompt_check}")
            r.equal = "NO"
        notes = [" ".join(n.split())[:160] for n in ([f"ERROR {r.error}"] if r.error else []) + r.notes]
        rows.append(
            (host.name, f"{r.phase}/{r.name} {r.what}", show(r.expected), show(r.got), r.equal, "; ".join(notes))
        )
    bad = [f"{r.phase}/{r.name}" for r in ordered if r.equal == "NO"]
    summary = f"{host.name}: {len(ordered) - len(bad)} of {len(ordered)} requests equal"
    summary += f"; differing: {', '.join(bad)}" if bad else ""
    results_list = [asdict(r) for r in ordered]
    return finish(run, phase_info, rows, bad, summary, prompt_check=checks, results=results_list)
