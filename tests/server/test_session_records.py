"""Sessions that survive restarts and are shared by replicas: two apps (two registries, two fake
engines sharing one encodings dict) over one REAL memory store, embedded in a temp dir or the
memory service over HTTP on a real Redis."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from memory_store.app import build_app as build_memory_service
from memory_store.backends import EmbeddedBackend, RedisBackend, RetryPolicy
from memory_store.client import MemoryStoreClient, http_client, in_process_client
from memory_store.settings import MemoryStoreSettings
from server.app import build_app
from server.auth import tenant_session_id
from server.sessions.records import SessionStore
from server.settings import ServerSettings, tenant_of
from tests.helpers import ThreadedServer
from tests.memory_store.conftest import FAST_RETRY, HashingEncoder
from tests.redis_process import RedisProcess
from tests.server.conftest import asgi_client
from tests.server.fake_engine import FakeEngine

API_KEY = "sk-replica-key"
OTHER_KEY = "sk-other-key"
MODEL = "fake-model"
FAST_HTTP_RETRY = RetryPolicy(attempts=2, base_delay_s=0.02, max_delay_s=0.05)
DOCUMENT = " ".join(f"word{i}" for i in range(60)) + " the passkey is 4242"


@dataclass
class Replica:
    app: FastAPI
    engine: FakeEngine
    http: httpx.AsyncClient

    @property
    def tenant(self) -> str:
        return tenant_of(API_KEY)

    async def metric(self, name: str) -> float:
        text = (await self.http.get("/metrics")).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))

    async def metric_labeled(self, name: str, key: str = API_KEY) -> float:
        """A per-tenant series, for `key`'s tenant."""
        text = (await self.http.get("/metrics")).text
        series = rf'^{re.escape(name)}{{tenant="{tenant_of(key)}"}} (\S+)$'
        match = re.search(series, text, re.M)
        assert match, f"{name} for the tenant not in /metrics"
        return float(match.group(1))

    async def chat(self, session_id: str, key: str = API_KEY) -> httpx.Response:
        return await self.http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "what is the passkey"}],
                "session_id": session_id,
            },
            headers={"Authorization": f"Bearer {key}"},
        )


@asynccontextmanager
async def replica(
    store: MemoryStoreClient, encodings: dict[str, int], **overrides: Any
) -> AsyncIterator[Replica]:
    settings = ServerSettings(
        **{"api_keys": [API_KEY, OTHER_KEY], "max_body_bytes": 256 * 1024, **overrides}
    )
    engine = FakeEngine(MODEL, encodings=encodings)
    app = build_app(settings, engine, store=store)
    async with asgi_client(app, API_KEY) as http:
        try:
            yield Replica(app, engine, http)
        finally:
            await app.state.sessions.close()
            await store.close()


async def create_with_document(r: Replica, text: str = DOCUMENT) -> tuple[str, dict[str, Any]]:
    created = await r.http.post("/v1/sessions", json={"metadata": {"team": "a"}})
    assert created.status_code == 200, created.text
    session_id = created.json()["id"]
    uploaded = await r.http.post(
        f"/v1/sessions/{session_id}/documents", json={"text": text, "name": "notes.txt"}
    )
    assert uploaded.status_code == 200, uploaded.text
    doc = await wait_ready(r, session_id, uploaded.json()["id"])
    return session_id, doc


async def wait_ready(r: Replica, session_id: str, doc_id: str) -> dict[str, Any]:
    for _ in range(500):
        doc = (await r.http.get(f"/v1/sessions/{session_id}/documents/{doc_id}")).json()
        if doc["status"] in ("ready", "failed"):
            assert doc["status"] == "ready", doc
            return dict(doc)
        await asyncio.sleep(0.01)
    raise AssertionError("the document never became ready")


def error_code(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return str(response.json()["error"]["code"])


# ---------------------------------------------------------------------------------------------
# Stores.
# ---------------------------------------------------------------------------------------------


def embedded_client(directory: Path) -> MemoryStoreClient:
    return in_process_client(EmbeddedBackend(directory), encoder=HashingEncoder())


def memory_service_app(redis: RedisProcess) -> FastAPI:
    backend = RedisBackend(redis.url, piece_bytes=64 * 1024, retry=FAST_RETRY, socket_timeout_s=2.0)
    return build_memory_service(
        MemoryStoreSettings(redis_url=redis.url), backend=backend, encoder=HashingEncoder()
    )


@dataclass
class MemoryService:
    """`longserve memory-store` on Redis, in a thread; `restart` is a new process's worth:
    a new app and backend on the same port."""

    redis: RedisProcess
    server: ThreadedServer

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def client(self) -> MemoryStoreClient:
        return http_client(self.url, retry=FAST_HTTP_RETRY, timeout_s=5)

    def stop(self) -> None:
        self.server.stop()

    def restart(self) -> None:
        self.server = ThreadedServer.of(
            memory_service_app(self.redis), self.server.port, lifespan="off"
        )
        self.server.start()


@pytest.fixture
def memory_service(redis_server: RedisProcess) -> Iterator[MemoryService]:  # noqa: F811
    server = ThreadedServer.of(memory_service_app(redis_server), lifespan="off")
    server.start()
    service = MemoryService(redis_server, server)
    try:
        yield service
    finally:
        service.stop()


# ---------------------------------------------------------------------------------------------
# (a) and (b): a second replica serves the session without running the model.
# ---------------------------------------------------------------------------------------------


async def check_second_replica_serves(first_store: Any, second_store: Any) -> None:
    encodings: dict[str, int] = {}
    async with replica(first_store, encodings) as first:
        session_id, doc = await create_with_document(first)
        assert first.engine.forwards > 0
        assert await first.metric("longserve:ingest_tokens_total") == doc["tokens"] == 64

    async with replica(second_store, encodings) as second:
        answer = await second.chat(session_id)
        assert answer.status_code == 200, answer.text
        assert "passkey" in answer.json()["choices"][0]["message"]["content"]
        engine_id = tenant_session_id(second.tenant, session_id)
        assert second.engine.ingested[engine_id] == [DOCUMENT]
        assert second.engine.forwards == 0
        assert await second.metric("longserve:ingest_tokens_total") == 0

        # The session as it was: id, metadata, documents with their ids, names and status.
        session = (await second.http.get(f"/v1/sessions/{session_id}")).json()
        assert session["metadata"] == {"team": "a"}
        assert session["documents"] == 1
        docs = (await second.http.get(f"/v1/sessions/{session_id}/documents")).json()["data"]
        assert [(d["id"], d["name"], d["status"], d["tokens"]) for d in docs] == [
            (doc["id"], "notes.txt", "ready", 64)
        ]
        ok = second.engine.calls[-1]
        assert ok.session_id == engine_id


async def test_second_replica_over_embedded_store(tmp_path: Path) -> None:
    await check_second_replica_serves(
        embedded_client(tmp_path / "store"), embedded_client(tmp_path / "store")
    )


async def test_second_replica_over_memory_service_on_redis(memory_service: MemoryService) -> None:
    await check_second_replica_serves(memory_service.client(), memory_service.client())


async def test_concurrent_requests_restore_once(tmp_path: Path) -> None:
    encodings: dict[str, int] = {}
    async with replica(embedded_client(tmp_path / "s"), encodings) as first:
        session_id, _ = await create_with_document(first)
    async with replica(embedded_client(tmp_path / "s"), encodings) as second:
        answers = await asyncio.gather(*(second.chat(session_id) for _ in range(6)))
        assert [a.status_code for a in answers] == [200] * 6
        engine_id = tenant_session_id(second.tenant, session_id)
        assert second.engine.ingested[engine_id] == [DOCUMENT]  # read once, not six times
        assert second.engine.forwards == 0


async def test_document_not_yet_read_is_read_by_the_replica_that_restores(tmp_path: Path) -> None:
    """Acknowledged uploads survive a crash before ingestion: the next replica reads them."""
    encodings: dict[str, int] = {}
    async with replica(embedded_client(tmp_path / "s"), encodings) as first:
        first.engine.ingest_gate.clear()  # the upload is acknowledged, never read here
        session_id = (await first.http.post("/v1/sessions")).json()["id"]
        uploaded = await first.http.post(
            f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT, "name": "late"}
        )
        assert uploaded.status_code == 200
    async with replica(embedded_client(tmp_path / "s"), encodings) as second:
        doc = await wait_ready(second, session_id, uploaded.json()["id"])
        assert doc["name"] == "late"
        assert second.engine.forwards > 0  # nobody had encoded it
        assert await second.metric("longserve:ingest_tokens_total") == 64
        assert (await second.chat(session_id)).status_code == 200


async def test_delete_removes_the_session_from_the_store(tmp_path: Path) -> None:
    encodings: dict[str, int] = {}
    async with replica(embedded_client(tmp_path / "s"), encodings) as first:
        session_id, _ = await create_with_document(first)
        assert (await first.http.delete(f"/v1/sessions/{session_id}")).status_code == 200
    assert not [p for p in (tmp_path / "s").iterdir() if session_id in p.name]
    async with replica(embedded_client(tmp_path / "s"), encodings) as second:
        assert error_code(await second.chat(session_id), 404) == "session_not_found"
        response = await second.http.get(f"/v1/sessions/{session_id}")
        assert error_code(response, 404) == "session_not_found"


async def test_delete_on_a_replica_that_does_not_hold_the_session(tmp_path: Path) -> None:
    encodings: dict[str, int] = {}
    async with replica(embedded_client(tmp_path / "s"), encodings) as first:
        session_id, _ = await create_with_document(first)
    async with replica(embedded_client(tmp_path / "s"), encodings) as second:
        assert (await second.http.delete(f"/v1/sessions/{session_id}")).status_code == 200
        assert second.engine.ingested == {}  # deleted without being restored
        assert (await second.http.delete(f"/v1/sessions/{session_id}")).status_code == 404


async def test_expired_session_is_not_restored(tmp_path: Path) -> None:
    encodings: dict[str, int] = {}
    async with replica(embedded_client(tmp_path / "s"), encodings) as first:
        session_id = (await first.http.post("/v1/sessions", json={"ttl_seconds": 60})).json()["id"]
    async with replica(embedded_client(tmp_path / "s"), encodings) as second:
        registry = second.app.state.sessions
        now = registry.clock()
        registry.clock = lambda: now + 61
        assert error_code(await second.chat(session_id), 404) == "session_not_found"


# ---------------------------------------------------------------------------------------------
# (d) Tenants stay apart across replicas.
# ---------------------------------------------------------------------------------------------


async def test_other_tenant_gets_404_on_another_replica(tmp_path: Path) -> None:
    encodings: dict[str, int] = {}
    async with replica(embedded_client(tmp_path / "s"), encodings) as first:
        session_id, doc = await create_with_document(first)
    async with replica(embedded_client(tmp_path / "s"), encodings) as second:
        other = {"Authorization": f"Bearer {OTHER_KEY}"}
        for response in (
            await second.chat(session_id, key=OTHER_KEY),
            await second.http.get(f"/v1/sessions/{session_id}", headers=other),
            await second.http.get(f"/v1/sessions/{session_id}/documents", headers=other),
            await second.http.get(
                f"/v1/sessions/{session_id}/documents/{doc['id']}", headers=other
            ),
            await second.http.delete(f"/v1/sessions/{session_id}", headers=other),
        ):
            assert error_code(response, 404) == "session_not_found"
        assert second.engine.sessions == set()  # nothing was restored for the other tenant
        assert (await second.chat(session_id)).status_code == 200  # the owner still can


async def test_unknown_or_malformed_session_ids_are_404(tmp_path: Path) -> None:
    async with replica(embedded_client(tmp_path / "s"), {}) as r:
        for session_id in ("sess_" + "0" * 32, "sess_..%2F..", "not-a-session"):
            assert error_code(await r.chat(session_id), 404) == "session_not_found"


# ---------------------------------------------------------------------------------------------
# (c) Faults: the store down, then back.
# ---------------------------------------------------------------------------------------------


async def test_redis_down_then_back(memory_service: MemoryService) -> None:
    async with replica(memory_service.client(), {}) as r:
        session_id, _ = await create_with_document(r)
        assert (await r.http.get("/ready")).status_code == 200

        memory_service.redis.kill()
        response = await r.http.post("/v1/sessions")
        assert error_code(response, 503) == "memory_store_unavailable"
        assert response.headers["Retry-After"]
        assert r.app.state.sessions.sessions(r.tenant) != []
        response = await r.http.post(
            f"/v1/sessions/{session_id}/documents", json={"text": "more words", "name": "x"}
        )
        assert error_code(response, 503) == "memory_store_unavailable"
        docs = (await r.http.get(f"/v1/sessions/{session_id}/documents")).json()["data"]
        assert len(docs) == 1  # the refused upload left nothing behind
        # a held session still answers, but its turn cannot be made durable: 503, and the
        # turn waits to be stored with the next finished request
        assert error_code(await r.chat(session_id), 503) == "memory_store_unavailable"
        held = r.app.state.sessions.held(r.tenant, session_id)
        assert [t.seq for t in held.unsaved] == [1]
        ready = await r.http.get("/ready")
        assert ready.status_code == 503 and "memory store" in ready.json()["detail"]
        assert (await r.http.get("/health")).status_code == 200
        assert (
            await r.metric(  # the create's first store call: its count in the ledger
                'longserve:memory_store_requests_total{backend="http",op="claim_usage",'
                'status="unavailable"}'
            )
            >= 1
        )

        memory_service.redis.start()  # same port, same directory (AOF)
        assert (await r.http.get("/ready")).status_code == 200
        created = await r.http.post("/v1/sessions")
        assert created.status_code == 200, created.text
        response = await r.http.post(
            f"/v1/sessions/{session_id}/documents", json={"text": "more words", "name": "x"}
        )
        assert response.status_code == 200, response.text
        await wait_ready(r, session_id, response.json()["id"])

    # What was acknowledged before the kill is still there.
    async with replica(memory_service.client(), {}) as second:
        docs = (await second.http.get(f"/v1/sessions/{session_id}/documents")).json()["data"]
        assert [d["status"] for d in docs] == ["ready", "ready"]


async def test_restore_while_the_store_is_down_is_503(memory_service: MemoryService) -> None:
    encodings: dict[str, int] = {}
    async with replica(memory_service.client(), encodings) as first:
        session_id, _ = await create_with_document(first)
    async with replica(memory_service.client(), encodings) as second:
        memory_service.redis.kill()
        assert error_code(await second.chat(session_id), 503) == "memory_store_unavailable"
        memory_service.redis.start()
        assert (await second.chat(session_id)).status_code == 200


async def test_document_read_while_the_engine_could_not_store_it(tmp_path: Path) -> None:
    """The engine read the document but could not store its encodings: ready here (the memory
    holds it), and saved as ready by the session's background save, not failed."""
    async with replica(embedded_client(tmp_path / "s"), {}) as r:
        r.engine.store_unavailable = True
        session_id = (await r.http.post("/v1/sessions")).json()["id"]
        uploaded = await r.http.post(
            f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT, "name": "n"}
        )
        doc = await wait_ready(r, session_id, uploaded.json()["id"])
        assert (await r.chat(session_id)).status_code == 200
        session = r.app.state.sessions.get(r.tenant, session_id)
        if session.saving is not None:
            await asyncio.wait([session.saving])
        record = await r.app.state.memory_store.load(r.tenant, session_id)
        assert [(d.id, d.status) for d in record.documents] == [(doc["id"], "ready")]


async def test_memory_service_down_then_back(memory_service: MemoryService) -> None:
    async with replica(memory_service.client(), {}) as r:
        session_id, _ = await create_with_document(r)
        await asyncio.to_thread(memory_service.stop)
        assert error_code(await r.http.post("/v1/sessions"), 503) == "memory_store_unavailable"
        assert error_code(await r.chat(session_id), 503) == "memory_store_unavailable"
        assert (await r.http.get("/ready")).status_code == 503
        await asyncio.to_thread(memory_service.restart)
        assert (await r.http.get("/ready")).status_code == 200
        assert (await r.http.post("/v1/sessions")).status_code == 200
        assert (await r.chat(session_id)).status_code == 200  # stores both turns, in order
        record = await SessionStore(memory_service.client()).load(r.tenant, session_id)
        assert record is not None and [t.seq for t in record.turns] == [1, 2]


async def test_store_latency_and_requests_are_measured(tmp_path: Path) -> None:
    async with replica(embedded_client(tmp_path / "s"), {}) as r:
        await create_with_document(r)
        text = (await r.http.get("/metrics")).text
        assert (
            'longserve:memory_store_requests_total{backend="embedded",op="put_record",'
            'status="ok"}' in text
        )
        assert (
            'longserve:memory_store_request_seconds_count{backend="embedded",op="put_record"}'
            in text
        )


def test_cli_builds_the_store_client(tmp_path: Path) -> None:
    from memory_store.client_http import HttpMemoryStoreClient
    from memory_store.client_inprocess import InProcessMemoryStoreClient
    from server.cli import memory_store_client

    embedded = memory_store_client(ServerSettings(data_dir=str(tmp_path / "d")))
    assert isinstance(embedded, InProcessMemoryStoreClient)
    assert embedded.backend_name == "embedded" and (tmp_path / "d" / "memory-store").is_dir()
    remote = memory_store_client(ServerSettings(memory_store_url="http://127.0.0.1:8001"))
    assert isinstance(remote, HttpMemoryStoreClient)


def test_cli_refuses_a_memory_store_that_is_not_a_service(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from server.cli import main

    assert main(["serve", "--memory-store", "redis://127.0.0.1:6379/0"]) == 2
    assert "memory_store_url" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Listing from the store's tenant index.
# ---------------------------------------------------------------------------------------------


async def list_ids(r: Replica, key: str = API_KEY) -> list[str]:
    response = await r.http.get("/v1/sessions", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return [s["id"] for s in response.json()["data"]]


async def test_listing_shows_every_replicas_sessions(tmp_path: Path) -> None:
    encodings: dict[str, int] = {}
    async with (
        replica(embedded_client(tmp_path / "s"), encodings) as a,
        replica(embedded_client(tmp_path / "s"), encodings) as b,
    ):
        on_a, doc = await create_with_document(a)
        on_b = (await b.http.post("/v1/sessions", json={"metadata": {"team": "b"}})).json()["id"]
        assert sorted(await list_ids(a)) == sorted(await list_ids(b)) == sorted([on_a, on_b])
        assert b.engine.sessions == {tenant_session_id(b.tenant, on_b)}  # listing restores nothing
        listed = {s["id"]: s for s in (await b.http.get("/v1/sessions")).json()["data"]}
        assert listed[on_a]["documents"] == 1 and listed[on_a]["memory_tokens"] == doc["tokens"]
        assert listed[on_a]["metadata"] == {"team": "a"}
        assert await list_ids(a, key=OTHER_KEY) == []

        # Deleted through B (which never held it): gone from A's listing, and A stops serving it.
        assert (await b.http.delete(f"/v1/sessions/{on_a}")).status_code == 200
        assert await list_ids(a) == [on_b]
        assert error_code(await a.chat(on_a), 404) == "session_not_found"
        assert tenant_session_id(a.tenant, on_a) not in a.engine.sessions


async def test_chat_on_a_replica_after_another_deleted_the_session(tmp_path: Path) -> None:
    encodings: dict[str, int] = {}
    async with (
        replica(embedded_client(tmp_path / "s"), encodings) as a,
        replica(embedded_client(tmp_path / "s"), encodings) as b,
    ):
        session_id, _ = await create_with_document(a)
        assert (await b.chat(session_id)).status_code == 200  # B restores and holds it too
        assert (await a.http.delete(f"/v1/sessions/{session_id}")).status_code == 200
        assert error_code(await b.chat(session_id), 404) == "session_not_found"
        assert b.app.state.sessions.sessions(b.tenant) == []


async def test_listing_with_the_store_down_lists_held_sessions(
    memory_service: MemoryService,
) -> None:
    async with replica(memory_service.client(), {}) as r:
        session_id = (await r.http.post("/v1/sessions")).json()["id"]
        memory_service.redis.kill()
        assert await list_ids(r) == [session_id]
        memory_service.redis.start()
        assert await list_ids(r) == [session_id]


async def test_an_unreadable_record_does_not_hide_the_others(tmp_path: Path) -> None:
    async with replica(embedded_client(tmp_path / "s"), {}) as a:
        good = (await a.http.post("/v1/sessions")).json()["id"]
    store = embedded_client(tmp_path / "s")
    bad = "sess_" + "f" * 32
    await store.put_record(f"tenant:{tenant_of(API_KEY)}", bad, {"id": bad})
    await store.put_record(f"sess:{tenant_session_id(tenant_of(API_KEY), bad)}", "session", {})
    async with replica(store, {}) as b:
        assert await list_ids(b) == [good]
