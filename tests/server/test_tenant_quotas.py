"""Per-tenant bounds counted in the memory store's usage ledger, so every replica sees the same
figure (fake engines; real embedded store, or the memory service over HTTP on a real Redis):
Responses metadata as OpenAI bounds it, stored responses bounded in bytes, sessions bounded
across replicas and restores."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from server.auth import tenant_session_id
from tests.server.test_session_records import (
    DOCUMENT,
    MODEL,
    OTHER_KEY,
    MemoryService,
    create_with_document,
    embedded_client,
    memory_service,  # noqa: F401 - fixture
    replica,
)
from tests.server.test_sessions import error_of


@pytest.mark.parametrize(
    "metadata",
    [
        {"k": "v" * 2 * 1024 * 1024},  # 2 MB in one value
        {f"k{i}": "v" for i in range(17)},  # 17 pairs
        {"k" * 65: "v"},  # a 65-character key
        {"k": "v" * 513},  # a 513-character value
        {"k": 5},  # values are strings only
    ],
)
async def test_response_metadata_is_bounded_as_openai_bounds_it(
    tmp_path: Path, metadata: dict[str, Any]
) -> None:
    async with replica(embedded_client(tmp_path / "s"), {}, max_body_bytes=4 * 1024 * 1024) as a:
        made = await a.http.post(
            "/v1/responses", json={"model": MODEL, "input": "hi", "metadata": metadata}
        )
        assert made.status_code == 400, made.text[:500]
        error = made.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"].startswith("metadata")
        assert "metadata" in error["message"] and len(error["message"]) < 200
        assert a.engine.calls == []  # nothing ran, nothing was stored
        assert not list((tmp_path / "s").rglob("*.rec"))


async def test_response_metadata_within_the_bounds_is_kept(tmp_path: Path) -> None:
    metadata = {f"k{i:02d}" + "x" * 60: "v" * 512 for i in range(16)}
    async with replica(embedded_client(tmp_path / "s"), {}) as a:
        made = await a.http.post(
            "/v1/responses", json={"model": MODEL, "input": "hi", "metadata": metadata}
        )
        assert made.status_code == 200, made.text
        got = await a.http.get(f"/v1/responses/{made.json()['id']}")
        assert got.json()["metadata"] == metadata


async def test_stored_response_bytes_are_bounded_per_tenant_across_replicas(
    tmp_path: Path,
) -> None:
    """Two replicas over one store: what A stored counts on B; past the bound store=true is a
    429 naming the limit, store=false still answers, another tenant is untouched, and a
    deletion gives the bytes back."""
    # One response of `big` stores about 9.5 KB: the input, the (echoed) answer, the output.
    limits = {"max_stored_response_bytes_per_tenant": 12_000}
    big = "word " * 600
    async with (
        replica(embedded_client(tmp_path / "s"), {}, **limits) as a,
        replica(embedded_client(tmp_path / "s"), {}, **limits) as b,
    ):
        first = await a.http.post("/v1/responses", json={"model": MODEL, "input": big})
        assert first.status_code == 200, first.text
        # Its input alone (3 KB) still fits on B, so B answers, then cannot store it: 429.
        second = await b.http.post("/v1/responses", json={"model": MODEL, "input": big})
        error = error_of(second, 429, "stored_response_limit")
        assert "max_stored_response_bytes_per_tenant" in error["message"]
        assert 9_000 < await b.metric_labeled("longserve:tenant_stored_bytes") < 12_000
        error_of(await b.http.get(f"/v1/responses/{second.json().get('id', 'resp_x')}"), 404,
                 "response_not_found")  # fmt: skip
        # An input that cannot fit is refused before anything runs.
        calls = len(b.engine.calls)
        third = await b.http.post("/v1/responses", json={"model": MODEL, "input": big * 2})
        error_of(third, 429, "stored_response_limit")
        assert len(b.engine.calls) == calls

        unstored = await b.http.post(
            "/v1/responses", json={"model": MODEL, "input": big, "store": False}
        )
        assert unstored.status_code == 200, unstored.text
        other = await b.http.post(
            "/v1/responses",
            json={"model": MODEL, "input": big},
            headers={"Authorization": f"Bearer {OTHER_KEY}"},
        )
        assert other.status_code == 200, other.text

        assert (await b.http.delete(f"/v1/responses/{first.json()['id']}")).status_code == 200
        again = await a.http.post("/v1/responses", json={"model": MODEL, "input": big})
        assert again.status_code == 200, again.text


# ---------------------------------------------------------------------------------------------
# Sessions counted across replicas: two apps over the memory service (HTTP) on a real Redis.
# ---------------------------------------------------------------------------------------------


async def test_session_limit_holds_across_replicas_and_restores(
    memory_service: MemoryService,
) -> None:
    encodings: dict[str, int] = {}
    limits = {"max_sessions_per_tenant": 2}
    async with (
        replica(memory_service.client(), encodings, **limits) as a,
        replica(memory_service.client(), encodings, **limits) as b,
    ):
        first, _ = await create_with_document(a)
        second = (await a.http.post("/v1/sessions", json={})).json()["id"]
        # B holds none of them, yet the tenant is at its limit: 429 there too.
        error = error_of(await b.http.post("/v1/sessions", json={}), 429, "session_limit")
        assert "2 sessions" in error["message"]
        assert b.engine.sessions == set()
        listed = (await b.http.get("/v1/sessions")).json()["data"]
        assert sorted(s["id"] for s in listed) == sorted([first, second])
        # Another tenant is not counted against this one.
        other = await b.http.post(
            "/v1/sessions", json={}, headers={"Authorization": f"Bearer {OTHER_KEY}"}
        )
        assert other.status_code == 200, other.text

        # A restore of a counted session on B is granted (counted once, not twice).
        assert (await b.chat(first)).status_code == 200
        store = memory_service.client()
        try:
            usage = await store.usage(b.tenant)
            held = (await b.http.get(f"/v1/sessions/{first}")).json()["memory_tokens"]
            assert held > 64  # the document and the chat's turn
            assert usage["sessions"] == 2 and usage["memory_tokens"] == held
            assert usage["documents"] == 1 and usage["document_bytes"] == len(DOCUMENT)
            assert await b.metric_labeled("longserve:tenant_stored_bytes") == len(DOCUMENT)

            # A session the ledger lacks (stored before it existed) does not fit: its restore
            # on B is refused cleanly, B's engine holds nothing for it, the store keeps it.
            await store.release_usage(b.tenant, second)
            third = (await b.http.post("/v1/sessions", json={})).json()["id"]
            refused = await b.chat(second)
            error_of(refused, 429, "session_limit")
            assert tenant_session_id(b.tenant, second) not in b.engine.sessions
            assert (await store.usage(b.tenant))["sessions"] == 2

            # Deleting gives the count back, through either replica; then B may create.
            assert (await b.http.delete(f"/v1/sessions/{third}")).status_code == 200
            assert (await store.usage(b.tenant))["sessions"] == 1
            assert (await b.chat(second)).status_code == 200  # fits now: restored and counted
            assert (await store.usage(b.tenant))["sessions"] == 2
            assert (await a.http.delete(f"/v1/sessions/{first}")).status_code == 200
            made = await b.http.post("/v1/sessions", json={})
            assert made.status_code == 200, made.text
        finally:
            await store.close()


async def test_memory_tokens_are_counted_across_replicas(memory_service: MemoryService) -> None:
    """64 tokens read through A count on B: a second 64-token document on B would take the
    tenant past 100, so it fails with memory_limit, and the ledger keeps only what is held."""
    encodings: dict[str, int] = {}
    limits = {"max_memory_tokens_per_tenant": 100}
    async with (
        replica(memory_service.client(), encodings, **limits) as a,
        replica(memory_service.client(), encodings, **limits) as b,
    ):
        await create_with_document(a)
        on_b = (await b.http.post("/v1/sessions", json={})).json()["id"]
        uploaded = await b.http.post(
            f"/v1/sessions/{on_b}/documents", json={"text": DOCUMENT, "name": "again.txt"}
        )
        assert uploaded.status_code == 200, uploaded.text
        doc_id = uploaded.json()["id"]
        for _ in range(500):
            doc = (await b.http.get(f"/v1/sessions/{on_b}/documents/{doc_id}")).json()
            if doc["status"] in ("ready", "failed"):
                break
            await asyncio.sleep(0.01)
        assert doc["status"] == "failed" and "memory tokens" in doc["error"], doc
        store = memory_service.client()
        try:
            usage = await store.usage(b.tenant)
        finally:
            await store.close()
        assert usage["memory_tokens"] == 64 and usage["documents"] == 1
        assert usage["sessions"] == 2


async def test_refused_requests_leave_no_count_behind(tmp_path: Path) -> None:
    """A create that fails after its claim (a missing collection), an upload past the
    document limit and a delete each leave the ledger as the tenant's held state says."""
    async with replica(embedded_client(tmp_path / "s"), {}, max_documents_per_session=1) as a:
        store = embedded_client(tmp_path / "s")
        try:
            failed = await a.http.post("/v1/sessions", json={"collections": ["missing"]})
            error_of(failed, 404, "collection_not_found")
            assert await store.usage(a.tenant) == {}

            session_id, _ = await create_with_document(a)
            counted = await store.usage(a.tenant)
            assert counted["sessions"] == 1 and counted["documents"] == 1
            refused = await a.http.post(
                f"/v1/sessions/{session_id}/documents", json={"text": "more", "name": "b.txt"}
            )
            error_of(refused, 429, "document_limit")
            assert await store.usage(a.tenant) == counted

            assert (await a.http.delete(f"/v1/sessions/{session_id}")).status_code == 200
            assert await store.usage(a.tenant) == {}
        finally:
            await store.close()


async def test_expiry_gives_the_count_back(tmp_path: Path) -> None:
    async with replica(embedded_client(tmp_path / "s"), {}) as a:
        store = embedded_client(tmp_path / "s")
        try:
            made = await a.http.post("/v1/sessions", json={"ttl_seconds": 60})
            assert made.status_code == 200, made.text
            assert (await store.usage(a.tenant))["sessions"] == 1
            registry = a.app.state.sessions
            now = registry.clock()
            registry.clock = lambda: now + 120  # past its TTL
            assert await registry.sweeper.sweep() == [made.json()["id"]]
            assert await store.usage(a.tenant) == {}
        finally:
            await store.close()
