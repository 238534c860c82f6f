"""Per-tenant limits across real replicas: two `longserve serve` processes over one
`longserve memory-store` on a real Redis. The tenant's sessions made through A count on B,
whichever replica the client picks; a restore on B past the limit is refused cleanly. Nothing
here asks the model, so the replicas serve conftest.py's tiny random model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.settings import tenant_of
from tests.e2e.conftest import API_KEY, start_servers, stop_server
from tests.e2e.test_replicas import MemoryServiceProcess
from tests.redis_process import RedisProcess


@pytest.fixture
def memory_service(tmp_path: Path, redis_server: RedisProcess) -> Iterator[MemoryServiceProcess]:
    service = MemoryServiceProcess(tmp_path, redis_server.url)
    service.start()
    try:
        yield service
    finally:
        service.kill()


def error_code(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return str(error["code"])


@pytest.mark.timeout(900)  # two server starts on a shared CPU
def test_session_limit_holds_across_server_replicas(
    tmp_path: Path,
    memory_service: MemoryServiceProcess,
    monkeypatch: pytest.MonkeyPatch,
    tiny_model: Path,
) -> None:
    monkeypatch.setenv("LONGSERVE_MAX_SESSIONS_PER_TENANT", "2")
    a, b = start_servers(
        tmp_path, 2, "--memory-store", memory_service.url, "--model", str(tiny_model)
    )
    tenant = tenant_of(API_KEY)
    ledger = f"{memory_service.url}/v1/usage/{tenant}"
    try:
        with httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
            ids = [http.post(f"{a.api_base}/sessions", json={}).json()["id"] for _ in range(2)]
            assert error_code(http.post(f"{b.api_base}/sessions", json={}), 429) == "session_limit"
            assert http.get(f"{b.api_base}/sessions/{ids[0]}").status_code == 200  # restored
            assert http.get(ledger).json()["totals"] == {"sessions": 2}  # counted once

            # A session the ledger lacks (stored before it existed) must fit to be restored.
            http.post(f"{ledger}/release", json={"item": ids[1]}).raise_for_status()
            assert http.post(f"{b.api_base}/sessions", json={}).status_code == 200
            refused = http.get(f"{b.api_base}/sessions/{ids[1]}")
            assert error_code(refused, 429) == "session_limit"
            assert http.get(ledger).json()["totals"] == {"sessions": 2}
            listed = http.get(f"{a.api_base}/sessions").json()["data"]
            assert ids[1] in [s["id"] for s in listed]  # the store still holds it

            assert http.delete(f"{a.api_base}/sessions/{ids[0]}").status_code == 200
            assert http.get(f"{b.api_base}/sessions/{ids[1]}").status_code == 200  # fits now
            assert f'longserve:tenant_stored_bytes{{tenant="{tenant}"}}' in b.metrics()
    finally:
        stop_server(a)
        stop_server(b)
