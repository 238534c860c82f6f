"""Limits on what a request may be, checked before a route sees it: the size of its head (path,
query and headers), the size of its body (a plain ASGI middleware, no buffering, works for
chunked bodies), the body's encoding (no Content-Encoding: we never inflate a body, so a
compression bomb is refused unread), and its JSON (strict UTF-8 and Unicode, bounded nesting),
parsed by the route class every route with a body uses.

Uvicorn's HTTP parser (h11) refuses a head only while it waits incomplete past a size (set to
MAX_HEAD_BYTES by server/drain.py), with a plain-text 400; a larger head that arrives whole in
one read reaches the app, which answers 431 here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import (
    body_too_large,
    error_response,
    headers_too_large,
    unsupported_content_encoding,
)

# Path, query string and headers together (cookies and bearer tokens fit many times over).
MAX_HEAD_BYTES = 32 * 1024


class BodySizeLimit:
    """413 when Content-Length says the body is too large, or when the bytes received pass the
    limit (chunked uploads, lying Content-Length)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    await error_response(body_too_large(limit))(scope, receive, send)
                    return
        received = 0
        exceeded = False
        response_started = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    exceeded = True
                    raise body_too_large(limit)
            return message

        async def guarded_send(message: Message) -> None:
            # Whatever the app makes of the aborted body read (FastAPI answers 400), the
            # client gets the 413.
            nonlocal response_started
            if exceeded:
                if not response_started:
                    response_started = True
                    await error_response(body_too_large(limit))(scope, receive, send)
                return
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not exceeded:
                raise
            if not response_started:
                await error_response(body_too_large(limit))(scope, receive, send)


class HeadSizeLimit:
    """431 when the path, query string and headers together pass MAX_HEAD_BYTES."""

    def __init__(self, app: ASGIApp, max_head_bytes: int = MAX_HEAD_BYTES) -> None:
        self.app = app
        self.max_head_bytes = max_head_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            size += sum(len(name) + len(value) + 4 for name, value in scope.get("headers", ()))
            if size > self.max_head_bytes:
                await error_response(headers_too_large(self.max_head_bytes))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RefuseEncodedBodies:
    """415 for a request body sent with a Content-Encoding (gzip, br, deflate...). Inflating
    bodies would let a few kilobytes expand past every size limit, so none is ever inflated."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope.get("headers", ()):
                if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
                    error = unsupported_content_encoding(value.decode("latin-1"))
                    await error_response(error)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def parse_json_body(body: bytes) -> Any:
    """RFC 8259 JSON: valid UTF-8, no lone surrogates, no NaN, at most ~200 levels deep (the
    parser's recursion limit), so hostile bodies fail here as 400s, not deep in the server.
    Failures are JSONDecodeErrors, which FastAPI turns into a json_invalid validation error."""
    try:
        return pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        raise json.JSONDecodeError(str(exc), "", 0) from None


class JSONBodyRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class JSONBodyRoute(APIRoute):
    """The route class of every router whose routes take a JSON body: bodies are parsed by
    parse_json_body instead of json.loads."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(JSONBodyRequest(request.scope, request.receive))

        return handle
