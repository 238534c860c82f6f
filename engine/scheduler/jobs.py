"""A job on the device thread: its steps, and the `Collector` that hands its outputs to asyncio."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from engine.scheduler.fair import ANONYMOUS

_ITEM, _ERROR, _END = "item", "error", "end"


class Collector:
    """Per-request mailbox: filled from the worker thread, drained by one async consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.closed = False  # set once _END or _ERROR was delivered

    def _put(self, kind: str, value: Any) -> None:
        # A closed loop raises RuntimeError: the consumer is gone, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, value))

    def put(self, item: Any) -> None:
        self._put(_ITEM, item)

    def fail(self, error: BaseException) -> None:
        if not self.closed:
            self.closed = True
            self._put(_ERROR, error)

    def end(self) -> None:
        if not self.closed:
            self.closed = True
            self._put(_END, None)

    async def get(self) -> tuple[bool, Any]:
        """(True, item) for the next output, (False, None) at the end; raises a job's error."""
        kind, value = await self._queue.get()
        if kind == _ERROR:
            raise value
        return (kind == _ITEM), value


class Steps(Protocol):
    """A job's work: each `next()` is one step, yielding an output for the collector or None
    for a quiet step; `close()` stops it early and frees its state (generators have both)."""

    def __iter__(self) -> Iterator[Any]: ...

    def __next__(self) -> Any: ...

    def close(self) -> None: ...


@dataclass(eq=False)
class Job:
    request_id: str
    steps: Steps
    collector: Collector
    session_id: str | None = None
    tenant: str = ANONYMOUS  # whose job it is: the unit of fair share
    # The output to send when the job is aborted (e.g. a delta with finish_reason "abort"),
    # given the last output sent; None sends nothing and just ends the stream.
    on_abort: Callable[[Any], Any] | None = None
    # Error to raise to the consumer when aborted (e.g. SessionNotFound after drop_session).
    abort_error: BaseException | None = None
    aborted: bool = False
    last_output: Any = None
    last_turn: int = 0  # the loop iteration in which it last ran a step on its own
