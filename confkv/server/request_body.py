"""Request bodies checked before a route's model sees them: text that is not Unicode.

JSON may escape a lone surrogate (`"\\ud800"`), which Python decodes into a `str` that no tokenizer,
log line or JSON response can encode: the prompt would fail in the tokenizer, and an error that
echoes the field would fail while it is written, both as 500s. Every route's body passes here first
(`CheckedRoute`, the routers' route class), and such text is refused as invalid input naming where it
is, in the route's own error shape (the validation error handler's).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

# A JSON escape of a surrogate code point; valid UTF-8 bytes never decode to one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]", re.ASCII)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class CheckedRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            body = await request.body()  # Starlette keeps it: the route reads it again
            if body and _SURROGATE_ESCAPE.search(body):  # cheap: most bodies escape no surrogate at all
                where = _lone_surrogate(_parsed(body))
                if where is not None:
                    raise RequestValidationError([_error(where)])
            return await handler(request)

        return checked


def _parsed(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return None  # not JSON: the route's own parsing refuses it


def _lone_surrogate(value: object, path: tuple = ()) -> tuple | None:
    """The path of the first key or string holding a lone surrogate (a valid pair is joined by the
    JSON decoder into one code point), else None."""
    if isinstance(value, str):
        return path if _LONE_SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if _LONE_SURROGATE.search(key):
                return (*path, _printable(key))
            found = _lone_surrogate(item, (*path, key))
            if found is not None:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, (*path, i))
            if found is not None:
                return found
    return None


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _error(path: tuple) -> dict:
    message = "text must be valid Unicode: it holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)"
    return {"type": "string_unicode", "loc": ("body", *path), "msg": message, "input": None}
