"""Fair share between tenants: the worker's waiting queue, by tenant.

Admission to the queue: at most `max_waiting` jobs in all and `max_waiting_per_tenant` of one
tenant, so one key flooding the queue gets the 429s while another still gets in. Admission to
the running set: the tenant with the fewest running jobs goes first (ties: the one admitted
least recently), each tenant's oldest job that can run, at most `max_running_per_tenant` of one
tenant. A tenant alone may use every running slot up to its cap; the cap keeps the rest free for
the next tenant's request without preempting anyone (docs/decisions/060).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from engine.protocol import EngineOverloaded

ANONYMOUS = ""
"""The tenant of jobs that name none (the engine used without a server): the only tenant
there, so no share caps it."""


class TenantJob(Protocol):
    tenant: str
    session_id: str | None
    aborted: bool


def session_tenant(session_id: str | None) -> str:
    """The tenant a session id names: the server's ids are "TENANT.SESSION"
    (server/auth.py tenant_session_id); any other id is a tenant of its own."""
    if session_id is None:
        return ANONYMOUS
    return session_id.partition(".")[0]


J = TypeVar("J", bound=TenantJob)


class FairQueue(Generic[J]):
    """Waiting jobs per tenant, in arrival order within a tenant. Not thread-safe: the worker
    holds its lock around every call."""

    def __init__(
        self, max_waiting: int, max_waiting_per_tenant: int, max_running_per_tenant: int
    ) -> None:
        self.max_waiting = max_waiting
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self.max_running_per_tenant = max_running_per_tenant
        self._queues: dict[str, collections.deque[J]] = {}
        self._size = 0
        self._order = itertools.count()
        self._last_admitted: dict[str, int] = {}  # tenant -> when it last got a running slot

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[J]:
        for queue in self._queues.values():
            yield from queue

    def waiting_of(self, tenant: str) -> int:
        queue = self._queues.get(tenant)
        return len(queue) if queue is not None else 0

    def push(self, job: J, running: list[J], max_running: int) -> None:
        """Queue a job; EngineOverloaded when the queue, or the tenant's share of it, is full.
        Running slots the tenant may take at the next admission count as room too, so a burst
        is not refused for jobs that are about to start."""
        if self._size >= self.max_waiting:
            raise EngineOverloaded(
                "The server's request queue is full; retry shortly.", retry_after=1.0
            )
        running_of_tenant = sum(1 for j in running if j.tenant == job.tenant)
        startable = min(max_running - len(running), self.max_running_per_tenant - running_of_tenant)
        share = self.max_waiting_per_tenant + max(0, startable)
        if job.tenant != ANONYMOUS and self.waiting_of(job.tenant) >= share:
            raise EngineOverloaded(
                f"This API key already has {self.max_waiting_per_tenant} requests waiting; "
                "retry shortly.",
                retry_after=1.0,
            )
        self._queues.setdefault(job.tenant, collections.deque()).append(job)
        self._size += 1

    def clear(self) -> None:
        self._queues.clear()
        self._size = 0

    def admit(self, running: list[J], max_running: int) -> list[J]:
        """Take the jobs that may start now out of the queue, in admission order: aborted jobs
        (to be cleaned up), then one job at a time from the tenant with the fewest running,
        never a job whose session is running one already (a session's jobs run in order)."""
        admitted = [job for job in self if job.aborted]
        for job in admitted:
            self._remove(job)
        busy = {job.session_id for job in running if job.session_id is not None}
        per_tenant = collections.Counter(job.tenant for job in running)
        slots = max_running - len(running)
        while slots > 0:
            picked = self._next(per_tenant, busy)
            if picked is None:
                break
            self._remove(picked)
            admitted.append(picked)
            slots -= 1
            per_tenant[picked.tenant] += 1
            self._last_admitted[picked.tenant] = next(self._order)
            if picked.session_id is not None:
                busy.add(picked.session_id)
        return admitted

    def _next(self, per_tenant: collections.Counter[str], busy: set[str]) -> J | None:
        best: tuple[int, int] | None = None
        best_job = None
        for tenant, queue in self._queues.items():
            if tenant != ANONYMOUS and per_tenant[tenant] >= self.max_running_per_tenant:
                continue
            job = next((j for j in queue if j.session_id not in busy), None)
            if job is None:
                continue
            rank = (per_tenant[tenant], self._last_admitted.get(tenant, -1))
            if best is None or rank < best:
                best, best_job = rank, job
        return best_job

    def _remove(self, job: J) -> None:
        queue = self._queues[job.tenant]
        queue.remove(job)
        self._size -= 1
        if not queue:
            del self._queues[job.tenant]
        if len(self._last_admitted) > 4 * (len(self._queues) + 256):  # forget gone tenants
            self._last_admitted = {t: self._last_admitted[t] for t in self._queues}
