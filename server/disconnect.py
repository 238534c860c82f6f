"""Work tied to one HTTP request: cancelled, with a 499, when the client goes away first."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from server.errors import APIError

T = TypeVar("T")


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; cancel it if the client goes away first (then aborting the engine)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task in done or task.done() and not task.cancelled():
        return task.result()
    raise APIError(499, "Client closed the request.", code="client_closed_request")


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
