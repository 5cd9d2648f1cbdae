"""ASGI middleware in front of every route: API keys and a request body size limit.

Both answer before the body is parsed, in the error shape of the route that was called (OpenAI's
on /v1, ours elsewhere).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

OPENAI_PREFIX = "/v1/"


def error_body(path: str, status: int, type_: str, message: str, param: str | None = None) -> dict:
    """Our error body; on the OpenAI routes OpenAI's shape, with our type as its `code`."""
    if path.startswith(OPENAI_PREFIX):
        kind = "invalid_request_error" if status < 500 else "server_error"
        if status == 401:
            kind = "authentication_error"
        return {"error": {"message": message, "type": kind, "param": param, "code": type_}}
    return {"error": {"type": type_, "message": message, **({"fields": param} if param else {})}}


async def _respond(send: Send, path: str, status: int, type_: str, message: str, headers: Iterable = ()) -> None:
    body = json.dumps(error_body(path, status, type_, message)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every route but the open ones (401 otherwise). Browser pages
    (`browser_paths`) may give the key as HTTP Basic's password instead: the 401 asks a browser for
    it, and the browser then sends it with the page's own requests."""

    def __init__(
        self, app: ASGIApp, keys: list[str], open_paths: set[str], browser_paths: frozenset[str] = frozenset()
    ) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.open_paths = open_paths
        self.browser_paths = browser_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        if not self._valid(dict(scope["headers"]).get(b"authorization", b"")):
            message = "a valid API key is required: send it as 'Authorization: Bearer <key>'"
            challenge = b'Basic realm="CONF-KV"' if scope["path"] in self.browser_paths else b"Bearer"
            return await _respond(send, scope["path"], 401, "unauthorized", message, [(b"www-authenticate", challenge)])
        return await self.app(scope, receive, send)

    def _valid(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        if scheme.lower() == b"basic":  # any user name; the key is the password
            try:
                token = base64.b64decode(token, validate=True).partition(b":")[2]
            except binascii.Error:
                return False
        elif scheme.lower() != b"bearer":
            return False
        # Compare with every key in constant time, so timing says nothing about near misses.
        return any([hmac.compare_digest(token, k) for k in self.keys])


class BodySizeLimitMiddleware:
    """Refuse request bodies over `max_bytes` with 413, by Content-Length or while reading."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        message = f"the request body is larger than {self.max_bytes} bytes (--max-request-bytes)"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _respond(send, path, 413, "request_too_large", message)

        if length is not None:
            return await self.app(scope, receive, send)  # the HTTP server holds the body to its length
        # No length (chunked): read it here, up to the limit, then hand it on.
        chunks, size = [], 0
        while True:
            event = await receive()
            if event["type"] != "http.request":
                return  # the client went away
            chunks.append(event.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _respond(send, path, 413, "request_too_large", message)
            if not event.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


class JSONBodyMiddleware:
    """Request bodies are JSON: another declared Content-Type gets 415 (no Content-Type is read as JSON)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH"):
            declared = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
            if declared and declared != b"application/json" and not declared.endswith(b"+json"):
                message = f"the body must be JSON: send Content-Type: application/json, not {declared.decode()!r}"
                return await _respond(send, scope["path"], 415, "unsupported_media_type", message)
        return await self.app(scope, receive, send)
