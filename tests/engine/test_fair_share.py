"""The worker's fair share between tenants (engine/scheduler/fair.py): per-tenant caps on the
waiting queue and on running slots, and running slots given to the tenant with the fewest.

Before it, the waiting queue was one FIFO: a tenant's flood took every waiting and running
place, and the next tenant's job was refused, or ran only after the whole flood."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.config import EngineConfig
from engine.protocol import EngineOverloaded
from engine.scheduler.fair import session_tenant
from engine.scheduler.jobs import Collector, Job
from engine.scheduler.worker import Worker
from tests.helpers import wait_until


class Gate:
    """Jobs that run (one quiet step at a time) until released; records which started when."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._released: set[str] = set()
        self._lock = threading.Lock()

    def steps(self, name: str):
        with self._lock:
            self.started.append(name)
        while True:
            with self._lock:
                if name in self._released:
                    return
            yield None

    def release(self, name: str) -> None:
        with self._lock:
            self._released.add(name)

    def running(self) -> list[str]:
        with self._lock:
            return [n for n in self.started if n not in self._released]


def _job(gate: Gate, loop, name: str, tenant: str, session_id: str | None = None) -> Job:
    return Job(name, gate.steps(name), Collector(loop), session_id=session_id, tenant=tenant)


async def test_a_flooding_tenant_is_refused_while_another_still_gets_in():
    worker = Worker(max_waiting=8, max_running=1, max_waiting_per_tenant=3)
    gate, loop = Gate(), asyncio.get_running_loop()
    try:
        worker.submit(_job(gate, loop, "a0", "A"))
        wait_until(lambda: gate.started == ["a0"], "a0 did not start")
        for i in range(1, 4):
            worker.submit(_job(gate, loop, f"a{i}", "A"))
        with pytest.raises(EngineOverloaded, match="This API key"):
            worker.submit(_job(gate, loop, "a4", "A"))
        worker.submit(_job(gate, loop, "b0", "B"))  # room is left for the other tenant
        assert worker.num_waiting == 4
    finally:
        worker.stop()


async def test_a_burst_may_fill_the_free_running_slots_and_its_share_of_the_queue():
    worker = Worker(
        max_waiting=8, max_running=4, max_waiting_per_tenant=2, max_running_per_tenant=3
    )
    gate, loop = Gate(), asyncio.get_running_loop()
    try:
        with worker._cond:  # the device thread admits nothing until the burst is in
            for i in range(5):  # 3 to start at once, 2 to wait
                worker.submit(_job(gate, loop, f"a{i}", "A"))
            with pytest.raises(EngineOverloaded):
                worker.submit(_job(gate, loop, "a5", "A"))
        wait_until(lambda: len(gate.started) == 3, lambda: str(gate.started))
        assert worker.num_waiting == 2
    finally:
        for i in range(5):
            gate.release(f"a{i}")
        worker.stop()


async def test_a_freed_slot_goes_to_the_tenant_with_the_fewest_running():
    worker = Worker(max_waiting=16, max_running=2)
    gate, loop = Gate(), asyncio.get_running_loop()
    try:
        for i in range(4):
            worker.submit(_job(gate, loop, f"a{i}", "A"))
        wait_until(lambda: gate.started == ["a0", "a1"], lambda: str(gate.started))
        worker.submit(_job(gate, loop, "b0", "B"))  # queued behind a2 and a3
        gate.release("a0")
        wait_until(lambda: len(gate.started) == 3, lambda: str(gate.started))
        assert gate.started[2] == "b0", gate.started  # FIFO would have run a2
        gate.release("a1")
        wait_until(lambda: len(gate.started) == 4, lambda: str(gate.started))
        assert gate.started[3] == "a2"
    finally:
        for name in ("a2", "a3", "b0"):
            gate.release(name)
        worker.stop()


async def test_one_tenant_keeps_slots_free_for_the_next():
    worker = Worker(max_waiting=16, max_running=4, max_running_per_tenant=3)
    gate, loop = Gate(), asyncio.get_running_loop()
    try:
        for i in range(6):
            worker.submit(_job(gate, loop, f"a{i}", "A"))
        wait_until(lambda: len(gate.started) == 3, lambda: str(gate.started))
        worker.submit(_job(gate, loop, "b0", "B"))
        wait_until(lambda: "b0" in gate.started, "b0 waited for a slot A left free")
        assert sorted(gate.running()) == ["a0", "a1", "a2", "b0"]
    finally:
        for name in ("a0", "a1", "a2", "a3", "a4", "a5", "b0"):
            gate.release(name)
        worker.stop()


async def test_a_session_s_jobs_still_run_one_at_a_time_in_order():
    worker = Worker(max_waiting=16, max_running=4)
    gate, loop = Gate(), asyncio.get_running_loop()
    try:
        worker.submit(_job(gate, loop, "s1", "A", session_id="A.s"))
        worker.submit(_job(gate, loop, "s2", "A", session_id="A.s"))
        worker.submit(_job(gate, loop, "x", "A"))
        wait_until(lambda: len(gate.started) == 2, lambda: str(gate.started))
        assert gate.started == ["s1", "x"]
        gate.release("s1")
        wait_until(lambda: len(gate.started) == 3, lambda: str(gate.started))
        assert gate.started[2] == "s2"
    finally:
        for name in ("s2", "x"):
            gate.release(name)
        worker.stop()


async def test_jobs_of_no_tenant_are_not_capped():
    worker = Worker(
        max_waiting=8, max_running=2, max_waiting_per_tenant=1, max_running_per_tenant=1
    )
    gate, loop = Gate(), asyncio.get_running_loop()
    try:
        for i in range(4):
            worker.submit(_job(gate, loop, f"j{i}", ""))  # the engine used without a server
        wait_until(lambda: len(gate.started) == 2, lambda: str(gate.started))
        assert worker.num_waiting == 2
    finally:
        for i in range(4):
            gate.release(f"j{i}")
        worker.stop()


def test_a_session_id_names_its_tenant():
    assert session_tenant("0123abcd.sess_1") == "0123abcd"
    assert session_tenant("standalone") == "standalone"
    assert session_tenant(None) == ""


def test_the_shares_default_to_fractions_of_the_queue():
    config = EngineConfig()
    assert (config.waiting_per_tenant, config.running_per_tenant) == (16, 6)
    small = EngineConfig(max_waiting_requests=2, max_running_requests=1)
    assert (small.waiting_per_tenant, small.running_per_tenant) == (1, 1)
    capped = EngineConfig(max_waiting_requests_per_tenant=100, max_running_requests_per_tenant=2)
    assert (capped.waiting_per_tenant, capped.running_per_tenant) == (64, 2)
    with pytest.raises(ValueError, match="per_tenant"):
        EngineConfig(max_running_requests_per_tenant=0)
