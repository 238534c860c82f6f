"""Document extraction that cannot hang the server: each upload is read in a worker process of
its own, under a CPU-time limit (RLIMIT_CPU, set in the child), an address-space limit
(RLIMIT_AS) and a wall-clock limit (the parent kills it), with a few slots per server and fewer
per tenant.

A thread cannot be stopped, and pypdf can spend minutes inside one page (nested form XObjects
multiply: a 2 KB page took 200 s, docs/decisions/060), so the work runs where it can be killed.
Worker processes come from a forkserver: never a fork of this process, which holds torch's
threads. Waiting for a slot is bounded too: past `queue_seconds` the upload is refused with
Retry-After (429 when the tenant holds its own share, 503 when others hold every slot).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import math
import multiprocessing
import os
import resource
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from server.documents import DocumentKind, DocumentLimits, DocumentText, Upload, extract_text
from server.errors import APIError, document_extraction_busy, document_extraction_timeout

logger = logging.getLogger(__name__)

UNREADABLE = ("error", 400, "The document cannot be read.", "file", "invalid_document")
# Inline text this short is checked on the event loop: there is nothing to extract.
INLINE_TEXT_CHARS = 65536


@dataclass(frozen=True)
class ExtractionLimits:
    slots: int  # extractions at once, per server
    slots_per_tenant: int  # ... of one tenant
    queue_seconds: float  # how long an upload may wait for a slot
    cpu_seconds: int  # CPU time of one extraction (RLIMIT_CPU in its process)
    memory_bytes: int | None = None  # its address space (RLIMIT_AS); None: unlimited
    nice: int = 0  # added to its niceness: it takes only the CPU the decode steps leave


def _context() -> Any:
    """Forkserver where there is one (Linux), spawn elsewhere: never a plain fork."""
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if "forkserver" in methods:
        context.set_forkserver_preload(["server.extraction"])
    return context


def _extract_in_child(
    conn: Connection,
    upload: Upload,
    limits: DocumentLimits,
    cpu_seconds: int,
    memory_bytes: int | None,
    nice: int = 0,
) -> None:
    """The worker process: one extraction, its outcome sent back as plain values (an APIError's
    fields or the text), never an exception's text."""
    if nice:
        os.nice(nice)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        cpu_seconds = min(cpu_seconds, hard - 1)
    # past the soft limit SIGXCPU ends it, past the hard one SIGKILL
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    if memory_bytes is not None:  # past it an allocation fails: MemoryError, a 400 below
        # on top of what the process already maps: a forkserver child starts with everything
        # the server's main module imported (torch's libraries: gigabytes of address space)
        limit = _address_space() + memory_bytes
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        text = extract_text(upload, limits, time.monotonic() + limits.timeout_seconds)
        conn.send(("ok", text.name, text.kind, text.text))
    except APIError as e:
        conn.send(("error", e.status_code, e.message, e.param, e.code))
    except BaseException:  # pypdf's own failures past those extract_text names, MemoryError
        conn.send(UNREADABLE)
    finally:
        conn.close()


def _address_space() -> int:
    """This process's mapped address space in bytes (Linux; 0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _Extraction:
    """One extraction's process, started and awaited on a thread; kill() from any thread."""

    def __init__(
        self,
        context: Any,
        upload: Upload,
        limits: DocumentLimits,
        cpu: int,
        memory: int | None,
        nice: int = 0,
    ) -> None:
        self._receiver, self._sender = context.Pipe(duplex=False)
        self.process = context.Process(
            target=_extract_in_child,
            args=(self._sender, upload, limits, cpu, memory, nice),
            daemon=True,
        )
        self._wall_seconds = limits.timeout_seconds
        self._lock = threading.Lock()
        self._killed = False  # no process may start after kill()
        self.pid: int | None = None  # while it runs

    def run(self) -> tuple[Any, ...] | None:
        """The child's message, or None when it was killed over a time limit. A child that
        died of anything else without a word (out of its address space where even the answer
        could not be sent) could not read the document."""
        try:
            with self._lock:
                if self._killed:
                    return None
                self.process.start()
                self.pid = self.process.pid
            self._sender.close()  # ours: EOF reaches the receiver once the child's is gone too
            if self._receiver.poll(self._wall_seconds):
                return tuple(self._receiver.recv())
            return None
        except EOFError:
            self.process.join()
            if self._killed or self.process.exitcode in (-signal.SIGKILL, -signal.SIGXCPU):
                return None
            return UNREADABLE
        except OSError:
            return None
        finally:
            if self.process.pid is not None:
                if self.process.exitcode is None:  # over the wall-clock limit
                    self.process.kill()
                self.process.join()
            with self._lock:
                self.pid = None
            self._receiver.close()

    def kill(self) -> None:
        with self._lock:
            self._killed = True
            if self.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)


class ExtractionSlots:
    """Extraction slots for the server and per tenant; waiting for one is bounded. All calls on
    the event loop."""

    def __init__(self, limits: ExtractionLimits) -> None:
        self._limits = limits
        self._held: collections.Counter[str] = collections.Counter()
        self._waiters: list[asyncio.Future[None]] = []

    def _free_for(self, tenant: str) -> bool:
        total = sum(self._held.values())
        return total < self._limits.slots and self._held[tenant] < self._limits.slots_per_tenant

    async def acquire(self, tenant: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._limits.queue_seconds
        while not self._free_for(tenant):
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, max(0.0, deadline - loop.time()))
            except TimeoutError:
                own = self._held[tenant] >= self._limits.slots_per_tenant
                raise document_extraction_busy(own, retry_after=1) from None
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self._held[tenant] += 1

    def release(self, tenant: str) -> None:
        self._held[tenant] -= 1
        if self._held[tenant] <= 0:
            del self._held[tenant]
        for waiter in self._waiters:  # each rechecks its own tenant's room
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()


class DocumentReader:
    """Reads uploads into text: short inline text on the loop, everything else in a worker
    process per upload, under the limits above."""

    def __init__(self, limits: DocumentLimits, extraction: ExtractionLimits) -> None:
        self.limits = limits
        self.extraction = extraction
        self._slots = ExtractionSlots(extraction)
        self._context = _context()
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None  # made on first use
        self.running: set[_Extraction] = set()  # the processes now working (for tests)

    async def read(self, upload: Upload, tenant: str) -> DocumentText:
        if upload.text is not None and len(upload.text) < INLINE_TEXT_CHARS:
            return extract_text(upload, self.limits, time.monotonic() + self.limits.timeout_seconds)
        await self._slots.acquire(tenant)
        limits = self.extraction
        extraction = _Extraction(
            self._context,
            upload,
            self.limits,
            limits.cpu_seconds,
            limits.memory_bytes,
            limits.nice,
        )
        self.running.add(extraction)
        try:
            loop = asyncio.get_running_loop()
            message = await loop.run_in_executor(self._executor(), extraction.run)
        finally:
            extraction.kill()  # a cancelled request does not leave its process working
            self.running.discard(extraction)
            self._slots.release(tenant)
        return self._outcome(message)

    def _outcome(self, message: tuple[Any, ...] | None) -> DocumentText:
        if message is None:
            logger.warning("document extraction passed its limits; its process was killed")
            raise document_extraction_timeout(self.limits.timeout_seconds)
        if message[0] == "ok":
            _, name, kind, text = message
            document_kind: DocumentKind = kind
            return DocumentText(name=name, kind=document_kind, text=text)
        _, status, error_message, param, code = message
        raise APIError(status, error_message, param=param, code=code)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        # Made again after close(): an app may run its lifespan more than once (tests do).
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.extraction.slots, thread_name_prefix="longserve-extract"
            )
        return self._threads

    def close(self) -> None:
        for extraction in list(self.running):
            extraction.kill()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None


def cpu_seconds_for(timeout_seconds: float) -> int:
    """The default CPU-time limit: the wall-clock limit, rounded up to whole seconds."""
    return max(1, math.ceil(timeout_seconds))
