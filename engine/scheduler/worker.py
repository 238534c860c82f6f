"""The one thread that owns the device, and the collectors that bridge it to asyncio.

Jobs are iterators: each `next()` is one unit of device work (a prefill or ingest chunk, one
decode token). The thread admits up to max_running_requests jobs from a bounded waiting queue,
fairly between tenants (engine/scheduler/fair.py). Each iteration of its loop (vLLM-style) runs
one step of one job that cannot batch (a prefill or ingest chunk; of the tenant, then the job,
least recently stepped, so a long ingestion never starves a chat nor one tenant's many reads
another's) and then ONE batched step of every job whose next step can batch (a decode token,
on any path: the engine's `can_batch`), through the engine's `run_batch`. With a
`decode_share`, a reading step of t seconds is followed by batched steps only, for
t * share / (1 - share) seconds, so streams beside a long read get several tokens per reading
chunk instead of one. Jobs that use the same session run one at a time, in arrival order. A
job's outputs go to its `Collector` (engine/scheduler/jobs.py), which hands them to the asyncio
loop with `call_soon_threadsafe`; no torch runs in async code.

Failures: an exception inside a job's step ends that job only (its consumer gets an EngineError).
When a batched step fails as a whole, its jobs run that step again one by one, so only the job
that fails alone fails. An exception in the loop itself marks the engine dead: every job fails
with EngineDead, and so does every later call.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from engine.protocol import EngineDead, EngineError
from engine.scheduler.fair import FairQueue
from engine.scheduler.jobs import Job

logger = logging.getLogger(__name__)

RunBatch = Callable[[list[Any]], Sequence[Any]]
"""Runs the next step of several jobs' steps (each `batch_ready`) together: one output (or
None, or the Exception that one job's step raised) per job, in order. Raises when the whole step
failed and changed nothing; the jobs then run the step one by one."""


class Worker:
    """Owns the device thread, the waiting queue and the running set.

    housekeeping, when given, runs on the device thread every housekeeping_interval_s seconds
    (between steps when busy, on a timer when idle); its exceptions are logged, not fatal.
    on_idle, when given, runs on the device thread once each time the last job has finished
    and nothing waits (engine/scheduler/heap.py's trim); its exceptions are logged too.
    """

    def __init__(
        self,
        max_waiting: int,
        max_running: int,
        name: str = "longserve-engine",
        run_batch: RunBatch | None = None,
        can_batch: Callable[[Any], bool] | None = None,
        housekeeping: Callable[[], None] | None = None,
        housekeeping_interval_s: float = 1.0,
        on_idle: Callable[[], Any] | None = None,
        decode_share: float = 0.0,
        max_waiting_per_tenant: int | None = None,
        max_running_per_tenant: int | None = None,
    ) -> None:
        if not 0.0 <= decode_share < 1.0:
            raise ValueError("decode_share must be in [0, 1)")
        self.max_waiting = max_waiting
        # while jobs read (steps that run alone), batched decode steps get this share of the
        # device time: after a reading step of t seconds they run for up to t*share/(1-share)
        self._decode_ratio = decode_share / (1.0 - decode_share)
        self._batch_credit = 0.0
        self.max_running = max_running
        self._run_batch = run_batch
        # whether a job's steps are at a step that may join a batch
        self._can_batch = can_batch or (lambda steps: bool(getattr(steps, "batch_ready", False)))
        self._housekeeping = housekeeping
        self._housekeeping_interval_s = housekeeping_interval_s
        self._next_housekeeping = time.monotonic() + housekeeping_interval_s
        self._on_idle = on_idle
        self._worked = False  # a job ran since on_idle last did
        self._turn = 0
        self._tenant_turns: dict[str, int] = {}  # tenant -> the iteration it last ran alone
        self._cond = threading.Condition()
        self._waiting: FairQueue[Job] = FairQueue(
            max_waiting,
            max_waiting_per_tenant or max_waiting,
            max_running_per_tenant or max_running,
        )
        self._running: list[Job] = []
        self._jobs: dict[str, Job] = {}
        self._calls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            collections.deque()
        )
        self._stopping = False
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- submitting side (any thread) -------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def is_alive(self) -> bool:
        return self.dead is None and not self._stopping and self._thread.is_alive()

    def check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDead(f"engine worker died: {self.dead!r}")
        if self._stopping:
            raise EngineDead("engine is shut down")

    def submit(self, job: Job) -> None:
        """Queue a job; raises EngineOverloaded at once when the waiting queue, or its
        tenant's share of it, is full."""
        with self._cond:
            self.check_alive()
            if job.request_id in self._jobs:
                raise EngineError(f"request id {job.request_id!r} is already in flight")
            self._waiting.push(job, self._running, self.max_running)
            self._jobs[job.request_id] = job
            self._cond.notify()

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Flag a job to stop before its next step. Idempotent; unknown ids are ignored."""
        with self._cond:
            job = self._jobs.get(request_id)
            if job is not None and not job.aborted:
                job.aborted = True
                job.abort_error = error
                self._cond.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the device thread between steps (session management); its result or
        exception lands in the returned future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self.check_alive()
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def jobs_for_session(self, session_id: str) -> list[str]:
        with self._cond:
            return [j.request_id for j in self._jobs.values() if j.session_id == session_id]

    def busy_sessions(self) -> set[str]:
        """Sessions with a job waiting or running."""
        with self._cond:
            return {j.session_id for j in self._jobs.values() if j.session_id is not None}

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- device thread -------------------------------------------------------------------------

    def _admit(self) -> None:
        """Move waiting jobs to running (caller holds the lock), fairly between tenants."""
        self._running.extend(self._waiting.admit(self._running, self.max_running))

    def _finish(self, job: Job) -> None:
        with self._cond:
            self._jobs.pop(job.request_id, None)
            if job in self._running:
                self._running.remove(job)

    def _close_steps(self, job: Job) -> None:
        try:
            job.steps.close()  # runs the generator's finally blocks: frees its state now
        except Exception:
            logger.exception("closing request %s failed", job.request_id)

    def _abort_job(self, job: Job) -> None:
        self._close_steps(job)
        self._finish(job)
        if job.abort_error is not None:
            job.collector.fail(job.abort_error)
            return
        if job.on_abort is not None:
            final = job.on_abort(job.last_output)
            if final is not None:
                job.collector.put(final)
        job.collector.end()

    def _step(self, job: Job) -> None:
        if job.aborted:
            self._abort_job(job)
            return
        try:
            output = next(job.steps)
        except Exception as e:  # StopIteration included
            self._fail(job, e)
            return
        self._deliver(job, output)

    def _deliver(self, job: Job, output: Any) -> None:
        if output is not None:
            job.last_output = output
            job.collector.put(output)
        if getattr(job.steps, "done", False):  # finished with this step: no empty step to end it
            # closed, not left suspended after its last yield: its finally blocks run and its
            # frame lets go of the request's state now, not when the cyclic GC next runs
            self._close_steps(job)
            self._finish(job)
            job.collector.end()

    def _fail(self, job: Job, e: Exception) -> None:
        if isinstance(e, StopIteration):
            self._finish(job)
            job.collector.end()
            return
        if isinstance(e, EngineError):
            self._finish(job)
            job.collector.fail(e)
            return
        logger.error("request %s failed", job.request_id, exc_info=e)
        self._close_steps(job)
        self._finish(job)
        error = EngineError(f"request failed: {type(e).__name__}: {e}")
        error.__cause__ = e
        job.collector.fail(error)

    def _step_batch(self, jobs: list[Job]) -> None:
        assert self._run_batch is not None
        try:
            outputs = self._run_batch([job.steps for job in jobs])
        except Exception:
            logger.exception(
                "a batched step of %d requests failed; running it one by one", len(jobs)
            )
            for job in jobs:
                self._step(job)
            return
        for job, output in zip(jobs, outputs, strict=True):
            if isinstance(output, Exception):
                self._fail(job, output)
            else:
                self._deliver(job, output)

    def _run_calls(self, calls: list[tuple[Callable[[], Any], concurrent.futures.Future]]) -> None:
        for fn, future in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # delivered to the caller, not fatal to the engine
                future.set_exception(e)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._calls or self._waiting or self._running):
                        if self._housekeeping is None:
                            self._cond.wait()
                            continue
                        remaining = self._next_housekeeping - time.monotonic()
                        if remaining <= 0:
                            break
                        self._cond.wait(remaining)
                    if self._stopping:
                        break
                    calls = list(self._calls)
                    self._calls.clear()
                    self._admit()
                    running = list(self._running)
                self._worked |= bool(running)
                self._run_calls(calls)
                self._loop_step(running)
                self._housekeep()
                self._idle()
        except BaseException as e:
            logger.exception("engine worker died")
            self.dead = e
        self._shutdown_jobs()

    def _idle(self) -> None:
        """on_idle, once the last job has finished and nothing waits."""
        if self._on_idle is None or not self._worked:
            return
        with self._cond:
            if self._waiting or self._running or self._calls:
                return
        self._worked = False
        try:
            self._on_idle()
        except Exception:
            logger.exception("engine idle hook failed")

    def _housekeep(self) -> None:
        if self._housekeeping is None or time.monotonic() < self._next_housekeeping:
            return
        try:
            self._housekeeping()
        except Exception:
            logger.exception("engine housekeeping failed")
        self._next_housekeeping = time.monotonic() + self._housekeeping_interval_s

    def _loop_step(self, running: list[Job]) -> None:
        """One iteration: one step of the job that ran alone least recently among those that
        cannot batch now, then one batched step of all those that can."""
        live = []
        for job in running:
            if job.aborted:
                self._abort_job(job)
            else:
                live.append(job)
        batch = [job for job in live if self._run_batch is not None and self._can_batch(job.steps)]
        alone = [job for job in live if job not in batch]
        if not batch:
            self._batch_credit = 0.0
        if alone and self._batch_credit <= 0.0:
            turns = self._tenant_turns
            job = min(alone, key=lambda j: (turns.get(j.tenant, 0), j.last_turn))
            self._turn += 1
            job.last_turn = turns[job.tenant] = self._turn
            if len(turns) > 4 * (len(running) + 256):  # forget tenants gone
                self._tenant_turns = {j.tenant: turns.get(j.tenant, 0) for j in running}
            started = time.perf_counter()
            self._step(job)
            if batch:  # decode steps are owed their share of that step's time
                self._batch_credit = (time.perf_counter() - started) * self._decode_ratio
        if batch:
            started = time.perf_counter()
            self._step_batch(batch)
            self._batch_credit -= time.perf_counter() - started

    def _shutdown_jobs(self) -> None:
        with self._cond:
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._waiting.clear()
            self._running.clear()
            calls = list(self._calls)
            self._calls.clear()
        reason = self.dead or RuntimeError("engine shut down")
        for job in jobs:
            self._close_steps(job)
            job.collector.fail(EngineDead(f"engine stopped: {reason!r}"))
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDead(f"engine stopped: {reason!r}"))
