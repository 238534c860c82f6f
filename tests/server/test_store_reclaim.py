"""The server's side of a store that gives back (issue #41 item 3), over a REAL embedded store:
a session whose replica is gone expires in the store all the same, and a failed document's
text is dropped."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from memory_store.client_inprocess import InProcessMemoryStoreClient
from server.auth import tenant_session_id
from server.settings import tenant_of
from tests.server.test_session_records import (
    API_KEY,
    DOCUMENT,
    create_with_document,
    embedded_client,
    replica,
)


def session_files(root: Path, session_id: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and session_id in str(p)]


async def test_a_session_whose_replica_is_gone_expires_in_the_store(tmp_path: Path) -> None:
    encodings: dict[str, int] = {}
    async with replica(embedded_client(tmp_path / "s"), encodings) as first:
        created = await first.http.post("/v1/sessions", json={"ttl_seconds": 60})
        session_id = created.json()["id"]
        uploaded = await first.http.post(
            f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT, "name": "a.txt"}
        )
        assert uploaded.status_code == 200
        await asyncio.sleep(0.2)
    # The replica that held it is gone (a restart, a deploy): its own sweeper never runs again.
    assert session_files(tmp_path / "s", session_id)
    store = embedded_client(tmp_path / "s")
    assert isinstance(store, InProcessMemoryStoreClient)
    async with replica(store, encodings, store_reclaim_interval_seconds=30) as second:
        sweeper = second.app.state.sessions.sweeper
        assert await sweeper.reclaim_if_due(force=True) == {
            "sessions_deleted": 0, "keys_deleted": 0, "chunks_deleted": 0, "bytes_reclaimed": 0
        }  # fmt: skip
        store.reclaimer.clock = lambda: time.time() + 60 * 1.25  # its TTL (and the save lag) on
        report = await sweeper.reclaim_if_due(force=True)
        assert report is not None and report["sessions_deleted"] == 1
        assert not session_files(tmp_path / "s", session_id)
        tenant = tenant_of(API_KEY)
        assert await store.list_records(f"tenant:{tenant}") == {}  # its index entry too
        assert await second.metric("longserve:memory_store_reclaimed_bytes_total") == float(
            report["bytes_reclaimed"]
        )
        listed = (await second.http.get("/v1/sessions")).json()["data"]
        assert listed == []


async def test_a_failed_document_drops_its_text(tmp_path: Path) -> None:
    encodings: dict[str, int] = {}
    store = embedded_client(tmp_path / "s")
    async with replica(store, encodings) as r:
        r.engine.ingest_chunk_tokens = 8
        r.engine.ingest_fail_after_chunks = 1
        session_id = (await r.http.post("/v1/sessions", json={})).json()["id"]
        uploaded = await r.http.post(
            f"/v1/sessions/{session_id}/documents", json={"text": DOCUMENT, "name": "a.txt"}
        )
        doc_id = uploaded.json()["id"]
        for _ in range(500):
            doc = (await r.http.get(f"/v1/sessions/{session_id}/documents/{doc_id}")).json()
            if doc["status"] == "failed":
                break
            await asyncio.sleep(0.01)
        assert doc["status"] == "failed"
        namespace = f"sess:{tenant_session_id(r.tenant, session_id)}"

        def text_files() -> list[Path]:
            return [p for p in session_files(tmp_path / "s", "") if f"text.{doc_id}" in p.name]

        for _ in range(200):  # the record, then the text, go after the status
            records = await store.list_records(namespace)
            if records.get(f"doc.{doc_id}", {}).get("status") == "failed" and not text_files():
                break
            await asyncio.sleep(0.01)
        assert records[f"doc.{doc_id}"]["status"] == "failed"
        assert text_files() == []
        # A document that is read keeps its text (a replica restoring the session reads it).
        r.engine.ingest_fail_after_chunks = None
        ok_session, ok_doc = await create_with_document(r)
        kept = [p for p in session_files(tmp_path / "s", "") if f"text.{ok_doc['id']}" in p.name]
        assert len(kept) == 1
