"""Collections attached to sessions over HTTP (fake engine): the API shapes, every error, and
attachments that survive a restore on another replica (real embedded store)."""

from __future__ import annotations

from pathlib import Path

import openai

from engine.protocol import MemorySpec
from server.auth import tenant_session_id
from tests.server.fake_engine import FakeEngine
from tests.server.test_session_records import embedded_client, replica
from tests.server.test_sessions import (
    OTHER_KEY,
    build,
    engine_id,
    error_of,
    http_client,
    new_session,
    sdk_client,
)


def stock(engine: FakeEngine) -> FakeEngine:
    """Collections as `longserve ingest` would have left them for this fake model."""
    engine.collections["manuals"] = (engine.fingerprint(None), 10, 5000)
    engine.collections["big-archive"] = (engine.fingerprint(None), 500, 250_000)
    engine.collections["other-model"] = ("another-model/segments/[]", 3, 1200)
    return engine


async def test_attach_on_create_and_later(engine: FakeEngine) -> None:
    app = build(stock(engine))
    async with http_client(app) as http:
        session = await new_session(http, collections=["manuals"])
        sid = session["id"]
        assert session["collections"] == ["manuals"]
        assert session["memory_tokens"] == 5000
        attached = await http.post(f"/v1/sessions/{sid}/collections", json={"name": "big-archive"})
        assert attached.status_code == 200, attached.text
        assert attached.json() == {
            "name": "big-archive",
            "object": "session.collection",
            "session_id": sid,
            "chunks": 500,
            "tokens": 0,
            "loading": "selected",
            "attached_at": attached.json()["attached_at"],
        }
        again = await http.post(f"/v1/sessions/{sid}/collections", json={"name": "big-archive"})
        assert again.json() == attached.json()  # idempotent
        listed = (await http.get(f"/v1/sessions/{sid}/collections")).json()
        assert listed["object"] == "list"
        assert [(c["name"], c["loading"]) for c in listed["data"]] == [
            ("manuals", "whole"),
            ("big-archive", "selected"),
        ]
        assert (await http.get(f"/v1/sessions/{sid}")).json()["collections"] == [
            "manuals",
            "big-archive",
        ]
        assert engine.attached[engine_id(sid)] == ["manuals", "big-archive"]

    async with sdk_client(app) as sdk:
        reply = await sdk.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "what do the manuals say"}],
            extra_body={"session_id": sid},
        )
        assert reply.choices[0].message.content
        assert engine.calls[-1].session_id == engine_id(sid)


async def test_attach_errors_change_nothing(engine: FakeEngine) -> None:
    app = build(stock(engine), max_collections_per_session=2)
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        url = f"/v1/sessions/{sid}/collections"
        error = error_of(await http.post(url, json={"name": "../etc"}), 400, None)
        assert error["param"] == "name"
        error_of(await http.post(url, json={"nom": "manuals"}), 400, None)
        error_of(await http.post(url, content=b"not json"), 400, None)
        error = error_of(await http.post(url, json={"name": "nope"}), 404, "collection_not_found")
        assert error["param"] == "name"
        error = error_of(
            await http.post(url, json={"name": "other-model"}), 409, "collection_incompatible"
        )
        assert "another model" in error["message"]
        assert (await http.get(f"/v1/sessions/{sid}")).json()["collections"] == []
        assert engine.attached.get(engine_id(sid)) is None

        # Memory knobs differ from those the collection was encoded with: 409 too.
        tuned = await new_session(http, memory={"strategy": "segments", "k": 2})
        response = await http.post(
            f"/v1/sessions/{tuned['id']}/collections", json={"name": "manuals"}
        )
        error_of(response, 409, "collection_incompatible")

        await http.post(url, json={"name": "manuals"})
        await http.post(url, json={"name": "big-archive"})
        engine.collections["third"] = engine.collections["manuals"]
        error_of(await http.post(url, json={"name": "third"}), 429, "collection_limit")

        unknown = "sess_" + "0" * 32
        error_of(
            await http.post(f"/v1/sessions/{unknown}/collections", json={"name": "manuals"}),
            404,
            "session_not_found",
        )


async def test_create_with_a_bad_collection_leaves_no_session(engine: FakeEngine) -> None:
    app = build(stock(engine))
    async with http_client(app) as http:
        error = error_of(
            await http.post("/v1/sessions", json={"collections": ["manuals", "bad name"]}),
            400,
            None,
        )
        assert error["param"] == "collections[1]"
        error_of(
            await http.post("/v1/sessions", json={"collections": ["manuals", "missing"]}),
            404,
            "collection_not_found",
        )
        error_of(
            await http.post("/v1/sessions", json={"collections": ["other-model"]}),
            409,
            "collection_incompatible",
        )
        assert (await http.get("/v1/sessions")).json()["data"] == []
        assert engine.sessions == set() and engine.attached == {}


async def test_another_tenants_session_is_404_whatever_the_body(engine: FakeEngine) -> None:
    app = build(stock(engine))
    async with http_client(app) as http:
        sid = (await new_session(http, collections=["manuals"]))["id"]
    async with http_client(app, key=OTHER_KEY) as other:
        for response in (
            await other.post(f"/v1/sessions/{sid}/collections", json={"name": "manuals"}),
            await other.post(f"/v1/sessions/{sid}/collections", content=b"garbage"),
            await other.get(f"/v1/sessions/{sid}/collections"),
        ):
            error_of(response, 404, "session_not_found")
        # Collections are readable by every tenant: the other tenant attaches it to its own.
        own = (await new_session(other, collections=["manuals"]))["id"]
        assert engine.attached[engine_id(own, OTHER_KEY)] == ["manuals"]


async def test_openai_sdk_reaches_the_collections_route(engine: FakeEngine) -> None:
    app = build(stock(engine))
    async with sdk_client(app) as sdk:
        session = await sdk.post("/sessions", body={"collections": ["manuals"]}, cast_to=object)
        assert session["collections"] == ["manuals"]
        try:
            await sdk.post(
                f"/sessions/{session['id']}/collections", body={"name": "nope"}, cast_to=object
            )
        except openai.NotFoundError as e:
            assert e.code == "collection_not_found"
        else:
            raise AssertionError("attaching an unknown collection succeeded")


async def test_attachments_survive_a_restore_on_another_replica(tmp_path: Path) -> None:
    encodings: dict[str, int] = {}
    async with replica(embedded_client(tmp_path / "s"), encodings) as first:
        stock(first.engine)
        created = await first.http.post("/v1/sessions", json={"collections": ["manuals"]})
        sid = created.json()["id"]
        response = await first.http.post(
            f"/v1/sessions/{sid}/collections", json={"name": "missing"}
        )
        error_of(response, 404, "collection_not_found")
    async with replica(embedded_client(tmp_path / "s"), encodings) as second:
        stock(second.engine)
        assert (await second.chat(sid)).status_code == 200  # restored here
        assert second.engine.attached[tenant_session_id(second.tenant, sid)] == ["manuals"]
        session = (await second.http.get(f"/v1/sessions/{sid}")).json()
        _, turns, turn_tokens = second.engine.turns[tenant_session_id(second.tenant, sid)]
        assert session["collections"] == ["manuals"] and session["turns"] == turns == 1
        assert session["memory_tokens"] == 5000 + turn_tokens  # the collection and the chat
        listed = (await second.http.get(f"/v1/sessions/{sid}/collections")).json()["data"]
        assert [(c["name"], c["loading"]) for c in listed] == [("manuals", "whole")]


async def test_restore_skips_a_collection_gone_since(tmp_path: Path) -> None:
    async with replica(embedded_client(tmp_path / "s"), {}) as first:
        stock(first.engine)
        sid = (await first.http.post("/v1/sessions", json={"collections": ["manuals"]})).json()[
            "id"
        ]
    async with replica(embedded_client(tmp_path / "s"), {}) as second:
        assert (await second.chat(sid)).status_code == 200  # no "manuals" here: left out
        assert (await second.http.get(f"/v1/sessions/{sid}")).json()["collections"] == []


def test_fake_fingerprint_follows_the_memory_spec() -> None:
    engine = FakeEngine()
    assert engine.fingerprint(None) != engine.fingerprint(MemorySpec("segments", {"k": 2}))
