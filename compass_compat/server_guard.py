"""Malformed image inputs answered with a 400 before they reach mlx-vlm's server (every pin answers
500, and none enforces its MAX_IMAGES): an ASGI middleware on ``/chat/completions`` and
``/responses`` (with or without ``/v1``); ``http(s)`` URLs pass unfetched (docs/hosts.md)."""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

from PIL import Image

GUARDED_ROUTES = ("/chat/completions", "/responses")
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class ImageRef:
    where: str  # JSON path of the image in the request, e.g. "messages[0].content[1]"
    source: Any


class BadRequest(ValueError):
    """A request the server cannot serve; ``str()`` is the message returned to the client."""

    def __init__(self, message: str, param: Optional[str] = None, code: str = "invalid_image"):
        super().__init__(message)
        self.param = param
        self.code = code


def _url_of(part: dict) -> Any:
    value = part.get("image_url")
    if isinstance(value, dict):
        return value.get("url")
    return value


def _parts(content: Any, where: str) -> Iterator[ImageRef]:
    if not isinstance(content, list):
        return
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") in ("image_url", "input_image"):
            yield ImageRef(f"{where}[{j}]", _url_of(part))


def image_refs(payload: Any) -> List[ImageRef]:
    """Every image a chat-completions or responses request carries, in order."""
    refs: List[ImageRef] = []
    if not isinstance(payload, dict):
        return refs
    for key in ("messages", "input"):
        items = payload.get(key)
        if not isinstance(items, list):
            continue
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                continue
            if item.get("type") == "input_image":  # a bare responses input item
                refs.append(ImageRef(f"{key}[{i}]", _url_of(item)))
            refs.extend(_parts(item.get("content"), f"{key}[{i}].content"))
    return refs


def _check_pixels(data: bytes, what: str, where: str) -> None:
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()  # open() only reads the header; truncation and decode errors show here
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise BadRequest(f"{where}: {what} is not a readable image ({err})", where) from err


def check_image(ref: ImageRef) -> None:
    """Raise :class:`BadRequest` when mlx-vlm could not load this image."""
    where, source = ref.where, ref.source
    if not isinstance(source, str) or not source.strip():
        raise BadRequest(f"{where}: the image part has no URL (expected image_url.url or image_url)", where)
    if source.startswith(("http://", "https://")):
        return
    if source.startswith("data:"):
        header, comma, encoded = source.partition(",")
        if not comma:
            raise BadRequest(f"{where}: malformed data URI (no comma after the media type)", where)
        if not header.startswith("data:image/"):
            raise BadRequest(f"{where}: data URI media type must be image/*, got {header[5:] or 'none'!r}", where)
        if not header.endswith(";base64"):
            raise BadRequest(f"{where}: only base64 data URIs are supported (data:image/...;base64,...)", where)
        try:
            raw = base64.b64decode(_WHITESPACE.sub("", encoded), validate=True)
        except (binascii.Error, ValueError) as err:
            raise BadRequest(f"{where}: data URI is not valid base64 ({err})", where) from err
        _check_pixels(raw, "the data URI", where)
        return
    if not os.path.isfile(source):
        raise BadRequest(f"{where}: image file not found: {source!r} (nor an http(s) or data: URL)", where)
    try:
        with open(source, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise BadRequest(f"{where}: cannot read image file {source!r}: {err}", where) from err
    _check_pixels(raw, f"file {source!r}", where)


def check_request(body: bytes, max_images: int) -> None:
    """Raise :class:`BadRequest` for a body mlx-vlm would fail on because of its images."""
    try:
        payload = json.loads(body) if body else None
    except (UnicodeDecodeError, ValueError) as err:
        raise BadRequest(f"request body is not valid JSON ({err})", code="invalid_json") from err
    refs = image_refs(payload)
    if len(refs) > max_images:
        raise BadRequest(
            f"the request carries {len(refs)} images; this server accepts at most {max_images} "
            "per request (compass-compat server --max-images)",
            code="too_many_images",
        )
    for ref in refs:
        check_image(ref)


def error_body(err: BadRequest) -> bytes:
    """OpenAI-style error object; ``detail`` repeats the message as FastAPI errors do."""
    message = str(err)
    error = {"message": message, "type": "invalid_request_error", "param": err.param, "code": err.code}
    return json.dumps({"error": error, "detail": message}).encode("utf-8")


def guarded(path: str) -> bool:
    path = path.rstrip("/")
    if path.startswith("/v1/"):
        path = path[3:]
    return path in GUARDED_ROUTES


class ImageRequestGuard:
    """ASGI middleware: 400 for malformed image inputs on the guarded routes.

    Starlette builds it as ``ImageRequestGuard(app, max_images=...)`` from
    ``app.add_middleware``. The body is read once and replayed to the wrapped app.
    """

    def __init__(self, app, max_images: int = 10):
        self.app = app
        self.max_images = max_images

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" or not guarded(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # client went away: nothing to answer
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            check_request(body, self.max_images)
        except BadRequest as err:
            await _respond(send, 400, error_body(err))
            return
        replayed = [False]

        async def replay():
            if not replayed[0]:
                replayed[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _respond(send, status: int, body: bytes) -> None:
    headers: List[Tuple[bytes, bytes]] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode("ascii")),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install(app, max_images: int) -> None:
    """Add the guard to a FastAPI/Starlette app before it starts serving."""
    app.add_middleware(ImageRequestGuard, max_images=max_images)
