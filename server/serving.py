"""What chat and completions share: request checks, the fan-out of n choices into n engine
requests, merging their deltas, metrics, SSE framing and client-disconnect handling.

Every engine iterator is closed on every path out (finished, failed, client gone), which is
how the engine learns to abort a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import anyio
from fastapi import Request
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from engine.protocol import (
    EngineClient,
    EngineError,
    GenerationDelta,
    MemorySpec,
    Prompt,
    SamplingParams,
)
from server.auth import tenant_session_id
from server.errors import (
    APIError,
    error_body,
    from_exception,
    invalid_request,
    model_not_found,
    server_shutting_down,
)
from server.metrics import Metrics
from server.protocol import MemoryRequest, UsageInfo
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A stream's headers wait this long for the first deltas, so that errors the engine raises at
# once (queue full, bad knob) still become HTTP statuses; a slow prefill does not hold them.
HEADERS_DEADLINE_SECONDS = 1.0

# When the server stops with streams still open (its drain timed out), each stream gets this
# long to send its error event and [DONE] before sse-starlette cuts it. Less than
# server.drain.SHUTDOWN_GRACE_SECONDS, after which uvicorn cancels whatever still runs.
STREAM_SHUTDOWN_GRACE_SECONDS = 1.0

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


@dataclass
class ServingContext:
    engine: EngineClient
    settings: ServerSettings
    metrics: Metrics


@dataclass(frozen=True)
class Job:
    """One engine request: one choice of one prompt."""

    index: int  # the choice index in the response
    prompt_index: int
    request_id: str
    prompt: Prompt
    sampling: SamplingParams


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------
# Request checks shared by chat and completions.
# ---------------------------------------------------------------------------------------------


def check_model(engine: EngineClient, model: str) -> str:
    served = engine.model.id
    if model != served:
        raise model_not_found(model)
    return served


def stop_sequences(settings: ServerSettings, stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop)
    stops = [s for s in stops if s]
    if len(stops) > settings.max_stop_sequences:
        raise invalid_request(
            f"At most {settings.max_stop_sequences} stop sequences are allowed.", param="stop"
        )
    return tuple(stops)


def check_max_tokens(settings: ServerSettings, value: int | None, param: str) -> int:
    if value is None:
        return settings.max_tokens_limit
    if value > settings.max_tokens_limit:
        raise invalid_request(
            f"{param} must be at most {settings.max_tokens_limit}, got {value}.", param=param
        )
    return value


def check_n(settings: ServerSettings, n: int | None) -> int:
    n = 1 if n is None else n
    if n > settings.max_n:
        raise invalid_request(f"n must be at most {settings.max_n}, got {n}.", param="n")
    return n


async def check_prompt_length(ctx: ServingContext, prompt: Prompt, chars: int, param: str) -> None:
    """Refuse prompts past max_prompt_tokens. A token holds at least one character, so short
    prompts skip the tokenizer."""
    limit = ctx.settings.max_prompt_tokens
    if chars <= limit:
        return
    tokens = await ctx.engine.count_tokens(prompt)
    if tokens > limit:
        raise APIError(
            400,
            f"The prompt has {tokens} tokens; this server accepts at most {limit}.",
            param=param,
            code="context_length_exceeded",
        )


def engine_memory(
    tenant: str, session_id: str | None, memory: MemoryRequest | None
) -> tuple[str | None, MemorySpec | None]:
    session = tenant_session_id(tenant, session_id) if session_id else None
    spec = MemorySpec(strategy=memory.strategy, params=memory.knobs()) if memory else None
    return session, spec


def top_k_of(top_k: int | None) -> int:
    return 0 if top_k is None or top_k < 0 else top_k  # vLLM spells "no cut" as -1


def fan_out(base_id: str, prompts: Sequence[Prompt], n: int, sampling: SamplingParams) -> list[Job]:
    """n choices per prompt; choice i of prompt p has index p*n+i and seed seed+i."""
    jobs = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            index = p * n + i
            seed = None if sampling.seed is None else sampling.seed + i
            request_id = f"{base_id}-{index}"
            jobs.append(Job(index, p, request_id, prompt, _with_seed(sampling, seed)))
    return jobs


def _with_seed(sampling: SamplingParams, seed: int | None) -> SamplingParams:
    return replace(sampling, seed=seed)


# ---------------------------------------------------------------------------------------------
# Running the jobs: one pump task per engine iterator, merged through a queue.
# ---------------------------------------------------------------------------------------------

_END = object()


@dataclass
class _ChoiceClock:
    """Per-choice timing for the latency metrics."""

    started: float
    last: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    finished: bool = False


@dataclass
class ChoiceStreams:
    """n engine generations running at once; iterate to get (choice index, delta) in arrival
    order. Always `await aclose()` (it aborts whatever is still running)."""

    ctx: ServingContext
    jobs: list[Job]
    session_id: str | None
    memory: MemorySpec | None
    _queue: asyncio.Queue[tuple[int, Any]] = field(default_factory=asyncio.Queue)
    _buffer: deque[tuple[int, Any]] = field(default_factory=deque)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _open: int = 0

    @classmethod
    async def start(
        cls,
        ctx: ServingContext,
        jobs: list[Job],
        session_id: str | None,
        memory: MemorySpec | None,
    ) -> ChoiceStreams:
        streams = cls(ctx, jobs, session_id, memory)
        started = time.perf_counter()
        iterators: list[AsyncIterator[GenerationDelta]] = []
        try:
            for job in jobs:
                iterators.append(
                    ctx.engine.generate(
                        job.request_id,
                        job.prompt,
                        job.sampling,
                        session_id=session_id,
                        memory=memory,
                    )
                )
        except BaseException:
            for iterator in iterators:
                await _aclose(iterator)
            raise
        for job, iterator in zip(jobs, iterators, strict=True):
            task = asyncio.create_task(streams._pump(job.index, iterator, started))
            streams._tasks.append(task)
        streams._open = len(jobs)
        return streams

    async def _pump(
        self, index: int, iterator: AsyncIterator[GenerationDelta], started: float
    ) -> None:
        clock = _ChoiceClock(started=started)
        reason = "abort"
        try:
            async for delta in iterator:
                self._observe(clock, delta)
                if delta.finish_reason == "error":
                    reason = "error"
                    raise EngineError("the engine failed while generating")
                self._queue.put_nowait((index, delta))
                if delta.finish_reason is not None:
                    reason = delta.finish_reason
                    break
            self._queue.put_nowait((index, _END))
        except Exception as exc:
            reason = "error"
            self._queue.put_nowait((index, exc))
        finally:
            await _aclose(iterator)
            if not clock.finished:  # aborted or failed: still one finished engine request
                self._finish_metrics(clock, reason, None)

    def _observe(self, clock: _ChoiceClock, delta: GenerationDelta) -> None:
        now = time.perf_counter()
        new_tokens = delta.completion_tokens - clock.tokens
        clock.prompt_tokens = delta.prompt_tokens
        if new_tokens > 0:
            if clock.last is None:
                self.ctx.metrics.first_token(now - clock.started)
                if new_tokens > 1:
                    self.ctx.metrics.inter_token(0.0, new_tokens - 1)
            else:
                self.ctx.metrics.inter_token(now - clock.last, new_tokens)
            clock.last = now
            clock.tokens = delta.completion_tokens
        if delta.finish_reason is not None and delta.finish_reason != "error":
            self._finish_metrics(clock, delta.finish_reason, delta)

    def _finish_metrics(
        self, clock: _ChoiceClock, reason: str, delta: GenerationDelta | None
    ) -> None:
        clock.finished = True
        self.ctx.metrics.request_finished(
            finish_reason=reason,
            e2e_seconds=time.perf_counter() - clock.started,
            prompt_tokens=clock.prompt_tokens,
            generation_tokens=clock.tokens,
            stats=delta.stats if delta else None,
        )

    async def prime(self, timeout: float) -> None:
        """Wait up to `timeout` for every choice's first event; raise the first error."""
        deadline = time.perf_counter() + timeout
        seen: set[int] = set()
        while len(seen) < len(self.jobs):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            try:
                item = await asyncio.wait_for(self._queue.get(), remaining)
            except TimeoutError:
                return
            self._buffer.append(item)
            seen.add(item[0])
            if isinstance(item[1], BaseException):
                raise item[1]

    def __aiter__(self) -> AsyncIterator[tuple[int, GenerationDelta]]:
        return self._events()

    async def _events(self) -> AsyncIterator[tuple[int, GenerationDelta]]:
        while self._open > 0:
            index, item = self._buffer.popleft() if self._buffer else await self._queue.get()
            if item is _END:
                self._open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    def interrupt(self, error: Exception) -> None:
        """End the iteration with `error` (raised by the iterator), whatever is still running."""
        self._queue.put_nowait((-1, error))
        self._buffer.clear()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def _aclose(iterator: AsyncIterator[Any]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        logger.exception("closing an engine iterator failed")


# ---------------------------------------------------------------------------------------------
# Usage accounting.
# ---------------------------------------------------------------------------------------------


@dataclass
class UsageCounter:
    """prompt tokens once per prompt (from the deltas), completion tokens summed over choices."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: dict[int, int] = field(default_factory=dict)

    def add(self, job: Job, delta: GenerationDelta) -> None:
        self.prompt_tokens[job.prompt_index] = delta.prompt_tokens
        self.completion_tokens[job.index] = delta.completion_tokens

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(self.completion_tokens.values())
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


# ---------------------------------------------------------------------------------------------
# Responses: SSE framing and disconnect handling.
# ---------------------------------------------------------------------------------------------


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


def sse_response(streams: ChoiceStreams, chunks: AsyncIterator[str]) -> EventSourceResponse:
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
    streams: ChoiceStreams, chunks: AsyncIterator[str], shutdown: anyio.Event | None = None
) -> AsyncIterator[str]:
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
