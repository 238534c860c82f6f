"""Request body size limit, as a plain ASGI middleware (no buffering, works for chunked bodies)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import body_too_large, error_response


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
