"""The asyncio side of work on the device thread: a job's outputs as an async iterator, and
one call awaited."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from engine.protocol import GenerationDelta, RequestStats
from engine.scheduler.fair import session_tenant
from engine.scheduler.jobs import Collector, Job, Steps
from engine.scheduler.worker import Worker

T = TypeVar("T")

OnAbort = Callable[[GenerationDelta | None], GenerationDelta]
"""The delta that ends an aborted request, given the last one sent."""


def aborted_delta(prompt_tokens: int) -> OnAbort:
    """The delta that ends an aborted request."""

    def on_abort(last: GenerationDelta | None) -> GenerationDelta:
        return GenerationDelta(
            text="",
            token_ids=[],
            prompt_tokens=prompt_tokens,
            completion_tokens=last.completion_tokens if last is not None else 0,
            finish_reason="abort",
            stats=RequestStats(queue_seconds=0.0),
        )

    return on_abort


class OutputStream(Generic[T]):
    """Async iterator over one job's outputs. Leaving early (aclose, cancellation, garbage
    collection) aborts the job in the worker."""

    def __init__(self, worker: Worker, request_id: str, collector: Collector) -> None:
        self._worker = worker
        self._request_id = request_id
        self._collector = collector
        self._done = False

    def __aiter__(self) -> OutputStream[T]:
        return self

    async def __anext__(self) -> T:
        if self._done:
            raise StopAsyncIteration
        try:
            has_item, item = await self._collector.get()
        except asyncio.CancelledError:
            self._close()
            raise
        except BaseException:
            self._done = True
            raise
        if not has_item:
            self._done = True
            raise StopAsyncIteration
        return item

    def _close(self) -> None:
        if not self._done:
            self._done = True
            if not self._collector.closed:
                self._worker.abort(self._request_id)

    async def aclose(self) -> None:
        self._close()

    def __del__(self) -> None:
        self._close()


def submit(
    worker: Worker,
    request_id: str,
    steps: Steps,
    session_id: str | None,
    on_abort: OnAbort | None,
    tenant: str | None = None,
) -> OutputStream[Any]:
    """Queue `steps` as a job on the device thread; its outputs come back through the stream.
    tenant: whose job it is (fair share); None: the tenant its session id names."""
    collector = Collector(asyncio.get_running_loop())
    owner = tenant if tenant is not None else session_tenant(session_id)
    job = Job(request_id, steps, collector, session_id=session_id, on_abort=on_abort, tenant=owner)
    try:
        worker.submit(job)
    except BaseException:
        steps.close()
        raise
    return OutputStream(worker, request_id, collector)


async def on_device(worker: Worker, fn: Callable[[], T]) -> T:
    """Run `fn` on the device thread between steps; its result or exception."""
    result: T = await asyncio.wrap_future(worker.call(fn))
    return result
