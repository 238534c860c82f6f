"""Answering a generation request: join its session, start its choices in the engine, then
gather them into one response or stream them as SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from sse_starlette import EventSourceResponse

from server.disconnect import until_disconnected
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.serving.choices import ChoiceRequest, ChoiceStreams, engine_memory
from server.serving.context import ServingContext
from server.serving.sse import sse_response

T = TypeVar("T")

# A stream's headers wait this long for the first deltas, so that errors the engine raises at
# once (queue full, bad knob) still become HTTP statuses; a slow prefill does not hold them.
HEADERS_DEADLINE_SECONDS = 1.0


async def answer_choices(
    ctx: ServingContext,
    request: ChatCompletionRequest | CompletionRequest,
    raw_request: Request,
    tenant: str,
    jobs: list[ChoiceRequest],
    gather: Callable[[ChoiceStreams], Awaitable[T]],
    stream_chunks: Callable[[ChoiceStreams, bool], AsyncIterator[str]],
) -> T | EventSourceResponse:
    """Run `jobs` for `request` (in its session, if it names one) and answer: `gather` makes
    the one response, `stream_chunks(streams, include_usage)` the serialized stream chunks."""
    session = None
    if request.session_id:
        session = await ctx.sessions.before_generate(tenant, request.session_id, raw_request)
    session_id, memory = engine_memory(tenant, request.session_id, request.memory)
    streams = await ChoiceStreams.start(ctx, jobs, session_id, memory, tenant, session)

    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return await answer(
        raw_request,
        streams,
        bool(request.stream),
        gather,
        lambda s: stream_chunks(s, include_usage),
    )


async def answer(
    raw_request: Request,
    streams: ChoiceStreams,
    stream: bool,
    gather: Callable[[ChoiceStreams], Awaitable[T]],
    stream_chunks: Callable[[ChoiceStreams], AsyncIterator[str]],
) -> T | EventSourceResponse:
    """Gather the choices into one response, or stream them as SSE once their first deltas are in
    (so an engine error raised at once still becomes an HTTP status, not an error event)."""
    if not stream:
        try:
            return await until_disconnected(raw_request, gather(streams))
        finally:
            await streams.aclose()
    try:
        await streams.prime(HEADERS_DEADLINE_SECONDS)
    except BaseException:
        await streams.aclose()
        raise
    return sse_response(streams, stream_chunks(streams))
