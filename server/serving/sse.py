"""Server-sent events: chunks framed as `data:` events, an error as one error event, then
[DONE]; the stream ends the same way when the server stops."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from server.error_mapping import from_exception
from server.errors import error_body, server_shutting_down
from server.serving.choices import ChoiceStreams

# When the server stops with streams still open (its drain timed out), each stream gets this
# long to send its error event and [DONE] before sse-starlette cuts it. Less than
# server.drain.SHUTDOWN_GRACE_SECONDS, after which uvicorn cancels whatever still runs.
STREAM_SHUTDOWN_GRACE_SECONDS = 1.0

# A serialized chunk (sent as `data:`), or {"event": name, "data": json} for a typed event
Event = str | dict[str, str]

# OpenAPI: a 200 is a JSON object or, with "stream": true, an SSE stream of `data:` events (a
# JSON chunk each, the last one "[DONE]").
STREAM_OK: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "properties": {"data": {"type": "string"}},
                    "required": ["data"],
                }
            }
        }
    }
}


def sse_response(streams: ChoiceStreams, chunks: AsyncIterator[Event]) -> EventSourceResponse:
    """The SSE response for serialized chunks. sse-starlette sets `shutdown` when the server
    stops (after its drain, server/drain.py): the stream then ends like any failed one."""
    shutdown = anyio.Event()
    # The background close covers a client gone before the event generator ever started.
    return EventSourceResponse(
        sse_events(streams, chunks, shutdown),
        sep="\n",
        shutdown_event=shutdown,
        shutdown_grace_period=STREAM_SHUTDOWN_GRACE_SECONDS,
        background=BackgroundTask(streams.aclose),
    )


async def sse_events(
    streams: ChoiceStreams, chunks: AsyncIterator[Event], shutdown: anyio.Event | None = None
) -> AsyncIterator[Event]:
    """Frame serialized chunks as SSE data; an error (the server stopping included) becomes one
    error event, then [DONE]. Closing (client gone) closes the engine iterators, which aborts
    the engine requests."""
    watcher = asyncio.create_task(_interrupt_on(shutdown, streams)) if shutdown else None
    try:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:
            error = from_exception(exc)
            yield json.dumps(error_body(error))
        yield "[DONE]"
    finally:
        if watcher is not None:
            watcher.cancel()
        with anyio.CancelScope(shield=True):
            await streams.aclose()


async def _interrupt_on(shutdown: anyio.Event, streams: ChoiceStreams) -> None:
    await shutdown.wait()
    streams.interrupt(server_shutting_down())
