"""A session's turns on the server (fake engine, real embedded store): stored before the
answer's last byte, replayed in order on another replica, counted in `turns` and
`memory_tokens`, and measured against the tenant's memory budget."""

from __future__ import annotations

from pathlib import Path

from server.auth import tenant_session_id
from server.sessions.records import SessionStore
from tests.server.test_session_records import (
    MODEL,
    create_with_document,
    embedded_client,
    replica,
)
from tests.server.test_sessions import error_of


async def test_a_turn_is_stored_before_the_answer_returns(tmp_path: Path) -> None:
    store = embedded_client(tmp_path / "s")
    async with replica(store, {}) as a:
        session_id, _ = await create_with_document(a)
        response = await a.chat(session_id)
        assert response.status_code == 200
        record = await SessionStore(store).load(a.tenant, session_id)
        assert record is not None and [t.seq for t in record.turns] == [1]
        stored = record.turns[0]
        assert (
            stored.encoded
            and stored.turn.answer == response.json()["choices"][0]["message"]["content"]
        )
        blob = await SessionStore(store).load_turn_encoding(a.tenant, session_id, 1)
        assert blob == b"fake-encoding-1"
        view = (await a.http.get(f"/v1/sessions/{session_id}")).json()
        assert view["turns"] == 1
        assert view["memory_tokens"] == stored.turn.turn_tokens + sum(
            d.tokens or 0 for d in record.documents
        )


async def test_another_replica_replays_the_turns_after_the_documents(tmp_path: Path) -> None:
    encodings: dict[str, int] = {}
    async with replica(embedded_client(tmp_path / "s"), encodings) as a:
        session_id, _ = await create_with_document(a)
        for _ in range(3):
            assert (await a.chat(session_id)).status_code == 200
        seen_on_a = (await a.http.get(f"/v1/sessions/{session_id}")).json()
    async with replica(embedded_client(tmp_path / "s"), encodings) as b:
        # listed from the store before any request restores it here
        listed = (await b.http.get("/v1/sessions")).json()["data"]
        assert [(s["turns"], s["memory_tokens"]) for s in listed] == [
            (seen_on_a["turns"], seen_on_a["memory_tokens"])
        ]
        assert (await b.chat(session_id)).status_code == 200  # restores, then turn 4
        engine_id = tenant_session_id(b.tenant, session_id)
        assert [t.seq for sid, t in b.engine.imported if sid == engine_id] == [1, 2, 3]
        assert all(t.encoding == b"fake-encoding-%d" % t.seq for _, t in b.engine.imported)
        view = (await b.http.get(f"/v1/sessions/{session_id}")).json()
        assert view["turns"] == seen_on_a["turns"] + 1 == 4
        assert view["memory_tokens"] > seen_on_a["memory_tokens"]


async def test_a_chat_past_the_memory_budget_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    store = embedded_client(tmp_path / "s")
    async with replica(store, {}, max_memory_tokens_per_tenant=200) as a:
        session_id, _ = await create_with_document(a)
        before = (await a.http.get(f"/v1/sessions/{session_id}")).json()
        ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        response = await a.http.post(
            "/v1/chat/completions", json={**ask, "session_id": session_id, "max_tokens": 1000}
        )
        error_of(response, 429, "memory_limit")
        after = (await a.http.get(f"/v1/sessions/{session_id}")).json()
        # The refused turn still counts as use: the session's lifetime may slide, nothing else.
        assert after.pop("expires_at") >= before.pop("expires_at")
        assert after == before
        record = await SessionStore(store).load(a.tenant, session_id)
        assert record is not None and record.turns == ()
        response = await a.http.post(
            "/v1/chat/completions", json={**ask, "session_id": session_id, "max_tokens": 4}
        )
        assert response.status_code == 200, response.text


async def test_a_replica_behind_the_store_restores_before_answering(tmp_path: Path) -> None:
    encodings: dict[str, int] = {}
    async with (
        replica(embedded_client(tmp_path / "s"), encodings) as a,
        replica(embedded_client(tmp_path / "s"), encodings) as b,
    ):
        session_id, _ = await create_with_document(a)
        assert (await a.chat(session_id)).status_code == 200  # turn 1 on A
        assert (await b.chat(session_id)).status_code == 200  # B restores it: turn 2
        assert (await a.chat(session_id)).status_code == 200  # A is behind: restores, turn 3
        engine_id = tenant_session_id(a.tenant, session_id)
        assert [t.seq for sid, t in a.engine.imported if sid == engine_id] == [1, 2]
        record = await SessionStore(embedded_client(tmp_path / "s")).load(a.tenant, session_id)
        assert record is not None and [t.seq for t in record.turns] == [1, 2, 3]
        chain = [t.turn for t in record.turns]
        assert all(x.hash_after == y.hash_before for x, y in zip(chain, chain[1:], strict=False))


async def test_a_turn_taken_on_a_stale_copy_is_never_acknowledged(
    tmp_path: Path, monkeypatch
) -> None:
    """Two replicas answer one session at once (the staleness check raced): the second to
    store its turn gets 409, its copy is dropped, and a retry reads the session as it is."""
    import server.sessions.registry as registry_module

    async def never_stale(_registry, _session) -> bool:
        return False

    encodings: dict[str, int] = {}
    async with (
        replica(embedded_client(tmp_path / "s"), encodings) as a,
        replica(embedded_client(tmp_path / "s"), encodings) as b,
    ):
        session_id, _ = await create_with_document(a)
        assert (await a.chat(session_id)).status_code == 200  # turn 1 on A
        assert (await b.chat(session_id)).status_code == 200  # turn 2 on B
        monkeypatch.setattr(registry_module, "stale", never_stale)
        error_of(await a.chat(session_id), 409, "session_conflict")
        assert a.app.state.sessions.held(a.tenant, session_id) is None
        monkeypatch.undo()
        assert (await a.chat(session_id)).status_code == 200  # restored: turn 3
        record = await SessionStore(embedded_client(tmp_path / "s")).load(a.tenant, session_id)
        assert record is not None and [t.seq for t in record.turns] == [1, 2, 3]
