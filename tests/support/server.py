"""``python -m compass_compat server`` (mlx-vlm's own server, patched) on 127.0.0.1, for the tests
and scripts that send it requests. The route each pin serves is in tests/test_server.py's
docstring. Test modules skip themselves where the pin's server cannot start (no uvicorn).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import mlx_vlm
from packaging.version import Version

VERSION = Version(str(mlx_vlm.__version__))
ROUTE = "/v1/responses" if VERSION < Version("0.5") else "/v1/chat/completions"
MAX_TOKENS = 12  # a request's max_tokens unless told
START_TIMEOUT = 240  # seconds; mlx-vlm 0.7.10 + transformers 5 import slowly on a busy CPU
REQUEST_TIMEOUT = 120
ROOT = Path(__file__).resolve().parents[2]


class ServerError(AssertionError):
    """The server exited or never answered /health (an AssertionError: a test fails on it)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A server process in its own process group, its output in ``log_path``; ``stop`` ends the group.

    What every server these tests and scripts start shares (ours below, the hosts' in
    scripts/hosts/common/e2e.py)."""

    def __init__(self, argv: List[str], log_path: Path, env: Dict[str, str], cwd: Path):
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            argv,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(cwd),
            start_new_session=True,  # its own process group: stop() ends its children too
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, first: int = signal.SIGTERM) -> Optional[int]:
        """``first`` (SIGTERM, or SIGINT as Ctrl+C sends it) to the group, then SIGKILL; returns the exit code."""
        if self.log.closed:  # stopped before
            return self.proc.returncode
        for sig, wait in ((first, 20), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # children it left behind
        self.log.close()
        return self.proc.returncode

    def log_size(self) -> int:
        with contextlib.suppress(OSError):
            return self.log_path.stat().st_size
        return 0

    def log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")

    def tail(self, n: int = 60) -> str:
        if not self.log.closed:
            self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


class Server(Process):
    """One server process for ``model``, started at once (output to ``log``), running this tree's
    compass_compat (``path`` goes before it on PYTHONPATH). ``with Server(...) as s`` waits for
    /health and stops it on the way out; ``post`` sends one request."""

    def __init__(
        self,
        model: Optional[Path],
        log: Path,
        *extra: str,
        env: Optional[Dict[str, str]] = None,
        path: Sequence[str] = (),
    ):
        if model is None:  # the server's own default: the default checkpoint
            from compass_data.toy import default_checkpoint_path

            self.model = str(default_checkpoint_path())
        else:
            self.model = str(model)
        self.port = free_port()
        env = {**{k: v for k, v in os.environ.items() if k != "COMPASS_COMPAT_AUTOPATCH"}, **(env or {})}
        # The installed compass_compat may be another checkout's editable install.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*path, str(ROOT), os.environ.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", "compass_compat", "server", *extra]
        argv += ["--model", self.model] if model is not None else []
        super().__init__(argv + ["--host", "127.0.0.1", "--port", str(self.port)], log, env, log.parent)

    def __enter__(self) -> "Server":
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self) -> "Server":
        if not self.came_up():
            raise ServerError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
        return self

    def came_up(self) -> bool:
        """Whether /health answered; False when the process exited first."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.5)
        raise ServerError(f"server neither served nor exited after {START_TIMEOUT}s:\n{self.tail()}")

    def request(self, body: dict, route: str = ROUTE) -> urllib.request.Request:
        """A JSON POST of ``body`` to ``route`` on this server."""
        return urllib.request.Request(
            f"http://127.0.0.1:{self.port}{route}",
            data=json.dumps(body).encode("utf-8"),
            headers={"Content-Type": "application/json"},
        )

    def post(self, content: list, max_tokens: int = MAX_TOKENS) -> tuple:
        """(status, parsed JSON body) of one non-streaming request with these content parts."""
        if ROUTE.endswith("/responses"):
            parts = [
                {"type": "input_image", "image_url": p["image_url"]["url"]}
                if p["type"] == "image_url"
                else {"type": "input_text", "text": p["text"]}
                for p in content
            ]
            body = {"input": [{"role": "user", "content": parts}], "max_output_tokens": max_tokens}
        else:
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        body.update(model=self.model, temperature=0.0, stream=False)
        try:
            with urllib.request.urlopen(self.request(body), timeout=REQUEST_TIMEOUT) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                return err.code, json.loads(raw)
            except ValueError:
                return err.code, {"raw": raw.decode("utf-8", "replace")}


@contextlib.contextmanager
def serving(started: Dict[str, Server], may_exit: Sequence[str] = ()) -> Iterator[Dict[str, Server]]:
    """Wait for servers started together (they import mlx-vlm in parallel), then stop them all on the
    way out. A name in ``may_exit`` may exit at start-up instead (its ``proc`` tells)."""
    try:
        for name, server in started.items():
            if name in may_exit:
                server.came_up()
            else:
                server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


def reply_text(body: dict) -> str:
    if "choices" in body:
        return body["choices"][0]["message"]["content"]
    if body.get("output_text"):
        return body["output_text"]
    return "".join(c.get("text", "") for item in body["output"] for c in item.get("content", []))


def data_uri(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(raw).decode("ascii")


# --------------------------------------------------------------------------- routes beyond chat completions
# Where each route may be, first found wins (a route the pin lacks answers 404).
ROUTE_PATHS = {"messages": ("/v1/messages",), "responses": ("/v1/responses",)}


def send(server: Server, route: str, body: dict, timeout: float = REQUEST_TIMEOUT) -> Tuple[int, bytes]:
    """(status, raw body) of one POST."""
    try:
        with urllib.request.urlopen(server.request(body, route), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def has_route(server: Server, route: str) -> bool:
    """An empty body: FastAPI answers 404 for a route the app lacks, 422 (or the handler's own
    error) for one it has."""
    return send(server, route, {})[0] != 404


def greedy_body(model: str, stream: bool, **route_fields: object) -> dict:
    """The fields every route's body shares (greedy), then the route's own (its max-tokens name among them)."""
    return {"model": model, "temperature": 0.0, "stream": stream, **route_fields}


def messages_body(model: str, prompt: str, image_b64: str = "", stream: bool = False) -> dict:
    """An Anthropic-style /v1/messages request."""
    content: object = prompt
    if image_b64:
        source = {"type": "base64", "media_type": "image/png", "data": image_b64}
        content = [{"type": "image", "source": source}, {"type": "text", "text": prompt}]
    return greedy_body(model, stream, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": content}])


def responses_body(model: str, prompt: str, image_b64: str = "", stream: bool = False) -> dict:
    """A responses-route request."""
    parts = [{"type": "input_text", "text": prompt}]
    if image_b64:
        parts.insert(0, {"type": "input_image", "image_url": "data:image/png;base64," + image_b64})
    return greedy_body(model, stream, max_output_tokens=MAX_TOKENS, input=[{"role": "user", "content": parts}])
