"""The preprocessing pool: tokenizing prompts, chat templates and grammar compilation, off
the asyncio loop and off the device thread (docs/decisions/057).

A few daemon threads run the jobs (a daemon does not hold the process at exit while a huge
prompt is still being tokenized). Fair between tenants: one tenant's jobs run on at most
`threads_per_tenant` threads at once, the others wait in its own line, and a line longer than
`max_waiting_per_tenant` gets EngineOverloaded (429) for that tenant only. A job counts
against its tenant until its thread is done with it, so a client that gives up does not free
a thread its abandoned prompt still holds; a job still waiting when its caller is cancelled
(a client disconnect) never runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from engine.protocol import EngineOverloaded

T = TypeVar("T")
logger = logging.getLogger(__name__)


def lower_thread_priority(nice: int) -> None:
    """Add `nice` to the calling thread's niceness (Linux schedules threads one by one), so a
    tenant's huge prompt being tokenized takes only the CPU the decode steps leave; a no-op
    where threads cannot be reniced."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:
        logger.info("preprocessing thread keeps its priority: %s", exc)


class Preprocessor:
    def __init__(
        self,
        threads: int,
        threads_per_tenant: int,
        max_waiting_per_tenant: int,
        on_start: Callable[[], Any] | None = None,
    ) -> None:
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]]
        self._jobs = queue.SimpleQueue()
        self._threads_per_tenant = threads_per_tenant
        self._max_waiting = max_waiting_per_tenant
        self._slots: dict[str, asyncio.Semaphore] = {}  # per tenant; loop side only
        self._waiting: dict[str, int] = {}  # jobs waiting for a slot, per tenant
        self._held: dict[str, int] = {}  # slots held (jobs queued or running), per tenant
        for i in range(threads):
            thread = threading.Thread(
                target=self._run, args=(on_start,), name=f"longserve-preprocess-{i}", daemon=True
            )
            thread.start()

    def _run(self, on_start: Callable[[], Any] | None) -> None:
        if on_start is not None:
            on_start()  # each thread's own state (its tokenizer copy), before any request
        while True:
            future, job = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # its caller went away before it started
            try:
                future.set_result(job())
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

    async def run(self, tenant: str | None, job: Callable[[], T]) -> T:
        """job() on a preprocessing thread, within the tenant's share; its exception, if any."""
        key = tenant or ""
        if self._waiting.get(key, 0) >= self._max_waiting:
            raise EngineOverloaded("too many prompts of this API key are being prepared")
        slots = self._slots.setdefault(key, asyncio.Semaphore(self._threads_per_tenant))
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            await slots.acquire()
        except BaseException:  # cancelled while waiting: its job never runs
            self._waiting[key] -= 1
            self._forget(key)
            raise
        self._waiting[key] -= 1
        self._held[key] = self._held.get(key, 0) + 1
        loop = asyncio.get_running_loop()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        # the slot comes back when the thread is done with the job (or it never started)
        future.add_done_callback(lambda _: _call_soon(loop, self._release, key, slots))
        self._jobs.put((future, job))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()  # a job not yet started never runs; a running one finishes alone
            raise

    def _release(self, key: str, slots: asyncio.Semaphore) -> None:
        slots.release()
        self._held[key] -= 1
        self._forget(key)

    def _forget(self, key: str) -> None:
        """Drop an idle tenant's entries, so that they do not pile up per API key seen."""
        if not self._held.get(key) and not self._waiting.get(key):
            self._held.pop(key, None)
            self._waiting.pop(key, None)
            self._slots.pop(key, None)

    @property
    def waiting(self) -> int:
        """Jobs waiting for their tenant's share of the threads."""
        return sum(self._waiting.values())


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nothing is left to release
        loop.call_soon_threadsafe(callback, *args)
