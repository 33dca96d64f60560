#!/usr/bin/env python3
"""End to end: oMLX's engine (`omlx serve`, PyPI flyto-mlx 0.7.0) serving compass-compat's default
checkpoint (the toy) through the startup hook, checked against `python -m compass_compat generate`.

Run it with the omlx environment's interpreter (scripts/hosts/omlx/env.sh builds it):

    .venvs/omlx-0.7.0/bin/python scripts/hosts/omlx/e2e.py [--max-tokens 12] [--out build/omlx]

What it does, in order:

1. locates (or builds once) the default checkpoint exactly as `python -m compass_compat generate`
   does (compass_data.toy.ensure_default_checkpoint, $COMPASS_COMPAT_HOME honoured) and copies it
   to OUT/models/toy-shapes-v5: `omlx serve --model-dir` serves every subfolder, and the
   folder name is the model id that requests name;
2. expected answers: one `python -m compass_compat generate --model OUT/models/toy-shapes-v5
   --no-verbose --temperature 0 --max-tokens N [--image ...|--no-image] --prompt TEXT` process per
   distinct request (a fresh process, so no model state carries over between requests);
3. prompt check, in this process: the host's own prompt pipeline (omlx's request model, message
   extraction and VLMBatchedEngine._process_chat_messages, called, not copied) against the CLI's
   (compass_compat.cli.main), comparing what each hands to mlx_vlm's prepare_inputs (prompt string)
   and what prepare_inputs returns (input_ids, pixel_values, image_grid_thw, ...) bit for bit;
4. starts `COMPASS_COMPAT_AUTOPATCH=1 omlx serve --model-dir OUT/models --base-path OUT/base
   --host 127.0.0.1 --port <free port>` (a fresh base path every run, so no paged SSD cache or
   settings from an earlier run; log in OUT/serve.log), waits for /v1/models (bounded), sends the
   requests below to /v1/chat/completions (greedy, fixed max_tokens), and always stops the server
   (SIGTERM to its process group, then SIGKILL);
5. prints `request | expected | got | match | notes`, writes OUT/results.json and exits 1 on any
   mismatch or error (2 when the environment is not usable).

Requests (images travel as base64 data URIs, image part first, then one text part):
  a  demo.png + "Describe this picture."                (first image: vision-feature cache miss)
  b  text only "Say hello."
  c  request a again with stream=true                    (same image: vision-feature cache hit)
  d  two fixture images + "Compare the two pictures."
  e  request a again                                      (vision-feature cache hit)
  f1-f3  three different requests at once (two images the server has not seen, one text-only,
         prompts of different lengths)
  v  a video_url part (the demo clip) + "Describe this picture.": oMLX 0.7.0 drops video parts
     before mlx-vlm sees them (docs/hosts.md), so this request is expected to be answered, and
     its prompt built, exactly as the same text without the video; when oMLX starts passing
     videos this request fails and the docs need the new behaviour

Matching: `got` must equal `expected` exactly, or after str.strip() of both ("yes, trimmed"):
oMLX's non-streaming reply is `clean_special_tokens(text)`, which strips surrounding whitespace.
Only loopback traffic; every wait is bounded (per request --request-timeout, whole run --deadline).

Which compass-compat: by default the checkout the environment's editable install points at,
uncommitted edits included (the run records `git status` of the package folders: SOURCES).
`--git-rev REV` tests a commit instead: `git archive` of those folders at REV (the ones it has)
goes to OUT/src-<sha> and the script re-runs itself with that tree first on PYTHONPATH, so this
process, the generate processes and the server all import that compass_compat, compass_data and
vendored model.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import mimetypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "images"
MODEL_ID = "toy-shapes-v5"  # the default checkpoint it serves (compass_data.toy.DEFAULT_CHECKPOINT)
AUTOPATCH = "COMPASS_COMPAT_AUTOPATCH"
REEXEC = "OMLX_E2E_SOURCE"  # set when re-run on an exported --git-rev tree
SOURCES = ("compass_compat", "compass_data", "vendor")  # what the package is made of


# --------------------------------------------------------------------------- cases
@dataclass
class Case:
    name: str
    images: List[str]
    text: str
    stream: bool = False
    group: str = "sequential"  # "sequential" or "concurrent"
    what: str = ""
    # Sent as video_url parts; the host is documented to drop them, so the reference is the
    # same request without them.
    dropped_videos: List[str] = field(default_factory=list)

    def key(self) -> Tuple[Tuple[str, ...], str, Tuple[str, ...]]:
        return tuple(self.images), self.text, tuple(self.dropped_videos)


@dataclass
class Result:
    name: str
    what: str
    expected: Optional[str] = None
    got: Optional[str] = None
    match: str = "NO"
    error: Optional[str] = None
    finish_reason: Optional[str] = None
    prompt_tokens_host: Optional[int] = None
    prompt_tokens_ref: Optional[int] = None
    prompt_check: str = "not run"
    vision_cache: str = ""
    seconds: float = 0.0
    notes: List[str] = field(default_factory=list)


def make_cases() -> List[Case]:
    from compass_compat.cli.generate import DEMO_IMAGE

    demo = str(DEMO_IMAGE)
    clip = str(Path(DEMO_IMAGE).with_name("demo_clip.avi"))
    return [
        Case("a", [demo], "Describe this picture.", what="image + text"),
        Case("b", [], "Say hello.", what="text only"),
        Case("c", [demo], "Describe this picture.", stream=True, what="= a, stream=true"),
        Case(
            "d",
            [str(FIXTURES / "synth_448x448.png"), str(FIXTURES / "synth_320x256.png")],
            "Compare the two pictures.",
            what="two images + text",
        ),
        Case("e", [demo], "Describe this picture.", what="= a again (vision cache hit)"),
        Case(
            "f1",
            [str(FIXTURES / "synth_501x379.png")],
            "What colours do you see in this picture?",
            group="concurrent",
            what="concurrent: image + text",
        ),
        Case(
            "f2",
            [],
            "Write one sentence about the sea, the wind and the sky at night.",
            group="concurrent",
            what="concurrent: text only",
        ),
        Case(
            "f3",
            [str(FIXTURES / "synth_256x320.png")],
            "Describe it.",
            group="concurrent",
            what="concurrent: image + short text",
        ),
        Case(
            "v",
            [],
            "Describe this picture.",
            dropped_videos=[clip],
            what="video part: oMLX drops it, = the text alone (documented)",
        ),
    ]


def request_body(case: Case, max_tokens: int) -> Dict[str, Any]:
    content: Any
    if case.images or case.dropped_videos:
        content = [{"type": "image_url", "image_url": {"url": data_uri(p)}} for p in case.images]
        content += [{"type": "video_url", "video_url": {"url": data_uri(p)}} for p in case.dropped_videos]
        content.append({"type": "text", "text": case.text})
    else:
        content = case.text
    body: Dict[str, Any] = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": case.stream,
    }
    if case.stream:
        body["stream_options"] = {"include_usage": True}
    return body


_URI_CACHE: Dict[str, str] = {}


def data_uri(path: str) -> str:
    if path not in _URI_CACHE:
        raw = Path(path).read_bytes()
        mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
        _URI_CACHE[path] = f"data:{mime};base64," + base64.b64encode(raw).decode("ascii")
    return _URI_CACHE[path]


def generate_argv(model_dir: Path, case: Case, max_tokens: int) -> List[str]:
    argv = [
        "generate",
        "--model",
        str(model_dir),
        "--no-verbose",
        "--temperature",
        "0",
        "--max-tokens",
        str(max_tokens),
    ]
    argv += ["--image", *case.images] if case.images else ["--no-image"]
    return argv + ["--prompt", case.text]


# --------------------------------------------------------------------------- helpers
def log(msg: str) -> None:
    print(f"[omlx-e2e] {msg}", flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self, cap: float) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the run's --deadline passed")
        return min(cap, left)


def versions() -> Dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("flyto-mlx", "mlx", "mlx-vlm", "mlx-lm", "transformers", "compass-compat"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "missing"
    return out


# --------------------------------------------------------------------------- source
def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True, timeout=60
    ).stdout


def export_rev(rev: str, out: Path) -> Path:
    """`git archive` of the SOURCES folders rev has into out/src-<sha> (reads objects only)."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    dest = out / f"src-{sha[:12]}"
    if not (dest / "compass_compat" / "__init__.py").is_file():
        tmp = out / f".src-{sha[:12]}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        present = [p for p in git("ls-tree", "--name-only", sha).split() if p in SOURCES]
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", sha, *present],
            check=True,
            capture_output=True,
            timeout=60,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True, timeout=60)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest


def source_info() -> Dict[str, Any]:
    import compass_compat

    info: Dict[str, Any] = {
        "compass_compat": str(Path(compass_compat.__file__).resolve().parent),
        "exported": os.environ.get(REEXEC),
    }
    with contextlib.suppress(Exception):
        info["head"] = git("log", "-1", "--format=%h %ci %s").strip()
        if not info["exported"]:
            dirty = git("status", "--porcelain", "--", *SOURCES).splitlines()
            info["uncommitted"] = [ln.strip() for ln in dirty]
    return info


# --------------------------------------------------------------------------- checkpoint
def prepare_model_dir(out: Path) -> Path:
    from compass_data.toy import ensure_default_checkpoint

    src = ensure_default_checkpoint()
    if src.name != MODEL_ID:
        raise RuntimeError(
            f"the default checkpoint is now {src.name!r}: set MODEL_ID to it, so the id names what is served"
        )
    models = out / "models"
    if models.exists():
        shutil.rmtree(models)
    dst = models / MODEL_ID
    shutil.copytree(src, dst)
    log(f"checkpoint {src} -> {dst} (model id {MODEL_ID!r})")
    return dst


# --------------------------------------------------------------------------- expected
def expected_text(model_dir: Path, case: Case, max_tokens: int, timeout: float) -> Tuple[Optional[str], Optional[str]]:
    """(text, error) from one `python -m compass_compat generate` process."""
    env = {k: v for k, v in os.environ.items() if k != AUTOPATCH}
    cmd = [sys.executable, "-m", "compass_compat", *generate_argv(model_dir, case, max_tokens)]
    try:
        proc = subprocess.run(cmd, capture_output=True, env=env, timeout=timeout, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return None, f"generate timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        return None, f"generate exited {proc.returncode}: {' | '.join(tail)}"
    text = proc.stdout.decode("utf-8")
    return (text[:-1] if text.endswith("\n") else text), None  # the CLI ends with one print()


# --------------------------------------------------------------------------- prompt check
class _Capture:
    """Wraps a module's prepare_inputs; records (prompts, images given, outputs)."""

    def __init__(self, module, name: str = "prepare_inputs"):
        self.module, self.name = module, name
        self.original = getattr(module, name)
        self.calls: List[Tuple[Any, Any, Dict[str, Any]]] = []

    def __enter__(self):
        def wrapper(processor, *args, **kwargs):
            out = self.original(processor, *args, **kwargs)
            self.calls.append((kwargs.get("prompts"), kwargs.get("images"), dict(out)))
            return out

        setattr(self.module, self.name, wrapper)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.original)


def _arrays_equal(a, b) -> bool:
    import numpy as np

    if a is None or b is None:
        return a is None and b is None
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))


def prompt_check(model_dir: Path, cases: List[Case], max_tokens: int) -> Dict[str, Dict[str, Any]]:
    """Per case: do the host and the CLI feed mlx-vlm's prepare_inputs the same prompt and images?"""
    import importlib

    # mlx_vlm.generate is also the name of a function in mlx_vlm's namespace: import by name.
    dispatch = importlib.import_module("mlx_vlm.generate.dispatch")
    vutils = importlib.import_module("mlx_vlm.utils")
    from mlx_vlm import load
    from omlx.api.openai_models import ChatCompletionRequest
    from omlx.api.utils import extract_multimodal_content
    from omlx.engine.vlm import VLMBatchedEngine

    import compass_compat.cli as cli

    model, processor = load(str(model_dir))
    engine = VLMBatchedEngine(model_name=str(model_dir))
    # What start() sets, without starting the scheduler: the loaded model and processor, the
    # tokenizer, and no vision-feature cache (it would only skip the encoder, not change inputs).
    engine._vlm_model, engine._processor = model, processor
    engine._tokenizer = getattr(processor, "tokenizer", processor)
    engine._vision_cache = None

    from omlx.models.vlm import VLMModelAdapter

    # Which decode branch oMLX's adapter takes for this model: with mRoPE it passes
    # position_ids built from the batch cache offsets plus per-request rope deltas.
    log(
        f"oMLX VLMModelAdapter sees mRoPE: {VLMModelAdapter._detect_mrope(model)} "
        f"(text_config.rope_scaling or rope_parameters with a top-level 'mrope_section')"
    )

    report: Dict[str, Dict[str, Any]] = {}
    seen: Dict[Tuple, Dict[str, Any]] = {}
    for case in cases:
        if case.key() in seen:
            report[case.name] = seen[case.key()]
            continue
        entry: Dict[str, Any] = {"ok": False}
        try:
            # Reference: the CLI's own code path (max 1 token; only the inputs matter here).
            with _Capture(dispatch) as ref, contextlib.redirect_stdout(io.StringIO()):
                rc = cli.main(generate_argv(model_dir, case, 1))
            if rc != 0 or len(ref.calls) != 1:
                raise RuntimeError(f"reference generate returned {rc} with {len(ref.calls)} prepare_inputs calls")
            ref_prompt, _, ref_out = ref.calls[0]
            # Host: the server's steps for /v1/chat/completions on a VLMBatchedEngine.
            req = ChatCompletionRequest(**request_body(case, max_tokens))
            extractor = engine.message_extractor
            if extractor is not None:
                messages = extractor(req.messages, None, engine.tokenizer)
            else:
                messages = extract_multimodal_content(req.messages, None, engine.tokenizer)
            with _Capture(vutils) as host:
                token_ids = engine._process_chat_messages(messages, None, {})[0]
            if not host.calls:
                raise RuntimeError("the host never called prepare_inputs")
            host_prompt, host_images, host_out = host.calls[0]
            ref_prompt = ref_prompt[0] if isinstance(ref_prompt, list) else ref_prompt
            host_prompt = host_prompt[0] if isinstance(host_prompt, list) else host_prompt
            entry["prompt_ref"], entry["prompt_host"] = ref_prompt, host_prompt
            entry["prompt_tokens"] = int(ref_out["input_ids"].shape[-1])
            diffs = []
            if ref_prompt != host_prompt:
                diffs.append("prompt string")
            keys = sorted(
                k for k in set(ref_out) | set(host_out) if (ref_out.get(k) is not None or host_out.get(k) is not None)
            )
            for k in keys:
                if not _arrays_equal(ref_out.get(k), host_out.get(k)):
                    diffs.append(k)
            if list(token_ids) != ref_out["input_ids"][0].tolist():
                diffs.append("token_ids returned")
            entry["compared"] = ["prompt string"] + keys
            entry["diffs"] = diffs
            entry["ok"] = not diffs
        except Exception as err:  # reported per case, the run goes on
            entry["error"] = f"{type(err).__name__}: {err}"
        seen[case.key()] = report[case.name] = entry
    return report


# --------------------------------------------------------------------------- server
class Server:
    def __init__(self, out: Path, port: int, log_level: str):
        self.out, self.port, self.log_level = out, port, log_level
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = out / "serve.log"
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> List[str]:
        exe = Path(sys.executable).with_name("omlx")
        return [
            str(exe),
            "serve",
            "--model-dir",
            str(self.out / "models"),
            "--base-path",
            str(self.out / "base"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            self.log_level,
        ]

    def start(self) -> None:
        base = self.out / "base"
        if base.exists():
            shutil.rmtree(base)  # no paged SSD cache, vision cache or settings from an earlier run
        env = dict(os.environ, **{AUTOPATCH: "1"})
        self._log = open(self.log_path, "wb")
        log(f"starting: {AUTOPATCH}=1 " + " ".join(self.command()))
        self.proc = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(self.out),
            start_new_session=True,
        )

    def wait_ready(self, timeout: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"omlx serve exited with {self.proc.returncode} before it was ready (see {self.log_path})"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/v1/models", timeout=2) as resp:
                    ids = [m.get("id") for m in json.load(resp).get("data", [])]
                if MODEL_ID in ids:
                    return time.monotonic() - start
                raise RuntimeError(f"omlx serve is up but lists {ids}, not {MODEL_ID!r}")
            except (urllib.error.URLError, ConnectionError, socket.timeout):
                time.sleep(0.5)
        raise TimeoutError(f"omlx serve not ready after {timeout:.0f} s (see {self.log_path})")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> Optional[int]:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, sig)
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:  # it exited by itself; still end any child it left in its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log:
            self._log.close()
        return self.proc.returncode

    def log_size(self) -> int:
        with contextlib.suppress(OSError):
            return self.log_path.stat().st_size
        return 0

    def log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")


def post_chat(base_url: str, body: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """One /v1/chat/completions call; returns text, finish_reason, prompt_tokens, error."""
    data = json.dumps(body).encode("utf-8")
    req = urllib.request.Request(
        base_url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    out: Dict[str, Any] = {"text": None, "finish_reason": None, "prompt_tokens": None, "error": None}
    status = None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status = resp.status
            if not body.get("stream"):
                reply = json.loads(resp.read())
                choice = reply["choices"][0]
                out["text"] = choice["message"].get("content") or ""
                out["finish_reason"] = choice.get("finish_reason")
                out["prompt_tokens"] = (reply.get("usage") or {}).get("prompt_tokens")
                return out
            parts, done, errors = [], False, []
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
        detail = err.read().decode("utf-8", "replace")[:300]
        out["error"] = f"HTTP {err.code}: {detail}"
    except Exception as err:  # connection reset, timeout, a body cut short, bad JSON, ...
        where = f"HTTP {status}, then " if status is not None else ""
        out["error"] = f"{where}{type(err).__name__}: {err}"
    return out


def vision_cache_note(segment: str) -> str:
    """What oMLX's vision-feature cache did (its debug lines): hits, stored misses, failures."""
    hits = segment.count("Vision feature cache hit")
    misses = segment.count("Vision feature cache miss")
    failed = segment.count("Vision feature computation failed")
    note = f"{hits} hit / {misses} miss" if hits or misses else ""
    if failed:
        note += (
            ", " if note else ""
        ) + f"{failed} not cacheable (oMLX: 'Vision feature computation failed, using full pipeline')"
    return note


def server_errors(segment: str) -> List[str]:
    """ERROR lines of the server log, without the timestamp."""
    out = []
    for ln in segment.splitlines():
        for level in (" - ERROR - ", " - CRITICAL - "):
            if level in ln:
                logger, _, message = ln.partition(level)
                out.append(f"{logger.rsplit(' - ', 1)[-1]}: {message}"[:300])
    return out


# --------------------------------------------------------------------------- table
def show(text: Optional[str], width: int) -> str:
    if text is None:
        return "-"
    s = json.dumps(text, ensure_ascii=False)[1:-1]  # newlines as \n, quotes escaped
    return s if len(s) <= width else s[: width - 3] + "..."


def print_table(results: List[Result], width: int) -> None:
    rows = [("request", "expected", "got", "match", "notes")]
    for r in results:
        notes = list(r.notes)
        if r.error:
            notes.insert(0, f"ERROR {r.error}")
        rows.append(
            (
                f"{r.name} {r.what}",
                show(r.expected, width),
                show(r.got, width),
                r.match,
                "; ".join(brief(n) for n in notes),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for i, row in enumerate(rows):
        print(" | ".join(cell.ljust(widths[j]) if j < 4 else cell for j, cell in enumerate(row)).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths) + "-+-" + "-" * 5)


def brief(note: str, limit: int = 150) -> str:
    """One line of at most ``limit`` characters (full texts are in results.json)."""
    note = " ".join(note.replace("\\n", " ").split())
    return note if len(note) <= limit else note[: limit - 3] + "..."


def judge(r: Result) -> None:
    if r.error or r.got is None or r.expected is None:
        r.match = "NO"
    elif r.got == r.expected:
        r.match = "yes"
    elif r.got.strip() == r.expected.strip():
        r.match = "yes, trimmed"
    else:
        r.match = "NO"
        n = next((i for i, (x, y) in enumerate(zip(r.got, r.expected)) if x != y), min(len(r.got), len(r.expected)))
        r.notes.append(f"differs from char {n}")


# --------------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=12, help="for every request (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "omlx", help="work folder (default: build/omlx)")
    ap.add_argument(
        "--log-level",
        default="debug",
        help="omlx serve --log-level (default: %(default)s; debug shows the vision-feature cache hits the notes count)",
    )
    ap.add_argument("--ready-timeout", type=float, default=120.0, help="seconds for omlx serve to come up")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds per HTTP request")
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds for the whole run (default: %(default)s)")
    ap.add_argument("--no-prompt-check", action="store_true", help="skip step 3 (in-process prompt comparison)")
    ap.add_argument("--width", type=int, default=48, help="table column width for texts")
    ap.add_argument(
        "--git-rev", help="test compass-compat as committed at this revision (e.g. HEAD) instead of the checkout"
    )
    args = ap.parse_args(argv)

    if args.git_rev and not os.environ.get(REEXEC):
        src = export_rev(args.git_rev, args.out.resolve())
        env = dict(os.environ, **{REEXEC: f"{args.git_rev} -> {src}"})
        env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
        log(f"re-running on {args.git_rev} exported to {src}")
        return subprocess.call(
            [sys.executable, str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv)], env=env
        )

    try:
        import omlx  # noqa: F401

        import compass_compat  # noqa: F401  (applies the patch in this process: the prompt check loads the model)
    except ImportError as err:
        print(
            f"omlx_e2e: run this with the omlx environment's python (.venvs/omlx-0.7.0/bin/python): {err}",
            file=sys.stderr,
        )
        return 2
    if not Path(sys.executable).with_name("omlx").exists():
        print(f"omlx_e2e: no omlx executable next to {sys.executable}", file=sys.stderr)
        return 2

    deadline = Deadline(args.deadline)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    from compass_compat import implementation_info

    info = implementation_info()
    src = source_info()
    log(f"compass_compat from {src['compass_compat']} (HEAD {src.get('head')})")
    if src.get("exported"):
        log(f"exported revision: {src['exported']}")
    elif src.get("uncommitted"):
        log(f"uncommitted changes in compass_compat/ or vendor/ are part of this run: {src['uncommitted']}")
    log(f"cohere_compass here: {info.implementation}, {info.file} ({info.reason})")
    model_dir = prepare_model_dir(out)
    cases = make_cases()
    results = {c.name: Result(c.name, c.what) for c in cases}

    # 2. expected answers, one fresh CLI process per distinct request
    t0 = time.monotonic()
    cache: Dict[Tuple, Tuple[Optional[str], Optional[str]]] = {}
    for case in cases:
        if case.key() not in cache:
            cache[case.key()] = expected_text(model_dir, case, args.max_tokens, deadline.left(120.0))
        text, err = cache[case.key()]
        results[case.name].expected = text
        if err:
            results[case.name].error = f"reference: {err}"
    log(f"expected answers: {len(cache)} generate processes in {time.monotonic() - t0:.1f} s")

    # 3. prompt check
    checks: Dict[str, Dict[str, Any]] = {}
    if not args.no_prompt_check:
        t0 = time.monotonic()
        checks = prompt_check(model_dir, cases, args.max_tokens)
        for name, entry in checks.items():
            r = results[name]
            r.prompt_tokens_ref = entry.get("prompt_tokens")
            if entry.get("error"):
                r.prompt_check = "error: " + entry["error"]
            else:
                r.prompt_check = "same" if entry["ok"] else "DIFFERS: " + ", ".join(entry["diffs"])
        log(
            f"prompt check ({time.monotonic() - t0:.1f} s): "
            + ", ".join(f"{n} {results[n].prompt_check}" for n in checks)
        )
        first = checks[cases[0].name]
        if "prompt_host" in first:
            log(f"host prompt of request {cases[0].name}: {first['prompt_host']!r}")
        text_case = next(c for c in cases if not c.images and not c.dropped_videos)
        if "prompt_host" in checks[text_case.name]:
            log(f"host prompt of request {text_case.name}: {checks[text_case.name]['prompt_host']!r}")

    # 4. the server
    server = Server(out, free_port(), args.log_level)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for s in previous:
        signal.signal(s, on_signal)
    server_rc = None
    try:
        server.start()
        log(f"server ready after {server.wait_ready(deadline.left(args.ready_timeout)):.1f} s on {server.base_url}")
        for case in [c for c in cases if c.group == "sequential"]:
            r = results[case.name]
            offset = server.log_size()
            t0 = time.monotonic()
            if not server.alive():
                r.error = "server is gone"
                continue
            reply = post_chat(server.base_url, request_body(case, args.max_tokens), deadline.left(args.request_timeout))
            r.seconds = time.monotonic() - t0
            time.sleep(0.3)  # let the log catch up
            segment = server.log_since(offset)
            absorb(r, reply, segment)
            log(f"{case.name}: {r.seconds:.1f} s, finish={r.finish_reason}, error={r.error}")

        group = [c for c in cases if c.group == "concurrent"]
        if group and server.alive():
            offset = server.log_size()
            replies: Dict[str, Dict[str, Any]] = {}
            barrier = threading.Barrier(len(group))
            timeout = deadline.left(args.request_timeout)

            def worker(case: Case) -> None:
                barrier.wait(timeout=30)
                start = time.monotonic()
                replies[case.name] = post_chat(server.base_url, request_body(case, args.max_tokens), timeout)
                replies[case.name]["seconds"] = time.monotonic() - start

            threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in group]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout + 40)
            time.sleep(0.3)
            segment = server.log_since(offset)
            for case in group:
                r = results[case.name]
                reply = replies.get(case.name) or {"error": "no reply (thread did not finish)"}
                r.seconds = reply.get("seconds", 0.0)
                absorb(r, reply, segment, shared_log=True)
                log(f"{case.name}: {r.seconds:.1f} s, finish={r.finish_reason}, error={r.error}")
        elif group:
            for case in group:
                results[case.name].error = "server is gone"
        if not server.alive():
            log(f"the server died (exit {server.proc.returncode}); see {server.log_path}")
    except (KeyboardInterrupt, TimeoutError, RuntimeError) as err:
        log(f"run aborted: {type(err).__name__}: {err}")
        for r in results.values():
            if r.got is None and not r.error:
                r.error = f"not sent ({type(err).__name__})"
    finally:
        server_rc = server.stop()
        for s, h in previous.items():
            signal.signal(s, h)
        log(f"server stopped (exit {server_rc}); log: {server.log_path}")

    # 5. verdict
    for r in results.values():
        if (
            r.prompt_tokens_host is not None
            and r.prompt_tokens_ref is not None
            and r.prompt_tokens_host != r.prompt_tokens_ref
        ):
            r.notes.append(f"prompt tokens host {r.prompt_tokens_host} vs ref {r.prompt_tokens_ref}")
        if not args.no_prompt_check and r.prompt_check != "same":
            r.notes.append(f"prompt check {r.prompt_check}")
        judge(r)
    ordered = [results[c.name] for c in cases]
    print()
    print_table(ordered, args.width)
    bad = [r.name for r in ordered if r.match == "NO" or (not args.no_prompt_check and r.prompt_check != "same")]
    summary = {
        "versions": versions(),
        "source": src,
        "max_tokens": args.max_tokens,
        "server_command": f"{AUTOPATCH}=1 " + " ".join(server.command()),
        "server_exit": server_rc,
        "results": [asdict(r) for r in ordered],
        "prompt_check": checks,
        "failed": bad,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print()
    print(
        f"[omlx-e2e] {len(ordered) - len(bad)} of {len(ordered)} requests match"
        + (f"; failing: {', '.join(bad)}" if bad else "")
    )
    log(f"details: {out / 'results.json'}")
    return 1 if bad else 0


def absorb(r: Result, reply: Dict[str, Any], segment: str, shared_log: bool = False) -> None:
    r.got = reply.get("text")
    r.finish_reason = reply.get("finish_reason")
    r.prompt_tokens_host = reply.get("prompt_tokens")
    if reply.get("error"):
        r.error = (r.error + "; " if r.error else "") + reply["error"]
    elif r.finish_reason not in ("length", "stop"):
        r.notes.append(f"finish_reason {r.finish_reason}")
    note = vision_cache_note(segment)
    if note:
        r.vision_cache = note
        r.notes.append(("group " if shared_log else "") + "vision cache " + note)
    errs = server_errors(segment)
    if errs and (r.error or r.got != r.expected):
        r.notes.append(("group " if shared_log else "") + f"server log: {errs[0]}")


if __name__ == "__main__":
    sys.exit(main())
