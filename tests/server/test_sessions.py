"""Sessions and documents over HTTP: upload once, ask many times (fake engine).

The session routes are driven with httpx (the openai SDK has no sessions API), chat with the
official openai SDK and `extra_body={"session_id": ...}`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from server.app import build_app
from server.auth import tenant_session_id
from server.sessions import SessionRegistry
from server.settings import ServerSettings, tenant_of
from tests.helpers import ThreadedServer, wait_until_async
from tests.server.conftest import API_KEY, MODEL
from tests.server.fake_engine import FakeEngine
from tests.server.test_documents import make_pdf

MESSAGES = [{"role": "user", "content": "what does it say"}]
OTHER_KEY = "sk-other-tenant"


# --- helpers ----------------------------------------------------------------------------------


@asynccontextmanager
async def http_client(app: FastAPI, key: str = API_KEY) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://test", headers={"Authorization": f"Bearer {key}"}
    ) as http:
        yield http


@asynccontextmanager
async def sdk_client(app: FastAPI, key: str = API_KEY) -> AsyncIterator[openai.AsyncOpenAI]:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    http = httpx.AsyncClient(transport=transport, base_url="http://test")
    async with openai.AsyncOpenAI(
        base_url="http://test/v1", api_key=key, http_client=http, max_retries=0
    ) as sdk:
        yield sdk


def build(engine: FakeEngine, **overrides: Any) -> FastAPI:
    settings = ServerSettings(
        **{"api_keys": [API_KEY, OTHER_KEY], "max_body_bytes": 256 * 1024, **overrides}
    )
    return build_app(settings, engine)


def registry(app: FastAPI) -> SessionRegistry:
    return app.state.sessions


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    assert error["message"]
    return error


async def new_session(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await http.post("/v1/sessions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def upload_text(
    http: httpx.AsyncClient, session_id: str, text: str, name: str | None = None
) -> dict[str, Any]:
    response = await http.post(
        f"/v1/sessions/{session_id}/documents", json={"text": text, "name": name}
    )
    assert response.status_code == 200, response.text
    return response.json()


async def follow(http: httpx.AsyncClient, session_id: str, doc_id: str) -> list[dict[str, Any]]:
    """The document's SSE progress events, up to and without the final [DONE]."""
    response = await http.get(
        f"/v1/sessions/{session_id}/documents/{doc_id}", params={"stream": "true"}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    data = [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


async def wait_ready(http: httpx.AsyncClient, session_id: str, doc_id: str) -> dict[str, Any]:
    events = await asyncio.wait_for(follow(http, session_id, doc_id), 5)
    assert events[-1]["status"] == "ready", events[-1]
    return events[-1]


async def documents_of(http: httpx.AsyncClient, session_id: str) -> list[dict[str, Any]]:
    response = await http.get(f"/v1/sessions/{session_id}/documents")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list"
    return body["data"]


def engine_id(session_id: str, key: str = API_KEY) -> str:
    return tenant_session_id(tenant_of(key), session_id)


# --- sessions ---------------------------------------------------------------------------------


async def test_create_list_get_delete(engine: FakeEngine) -> None:
    app = build(engine)
    async with http_client(app) as http:
        session = await new_session(
            http,
            memory={"strategy": "tokens", "k": 32},
            ttl_seconds=60,
            metadata={"case": "42"},
        )
        assert re.fullmatch(r"sess_[0-9a-f]{32}", session["id"])
        assert session["object"] == "session"
        assert session["memory"] == {"strategy": "tokens", "params": {"k": 32}, "tier": "device"}
        assert session["ttl_seconds"] == 60
        assert session["expires_at"] - session["created_at"] in (59, 60, 61)
        assert session["documents"] == 0 and session["memory_tokens"] == 0
        assert session["status"] == "ready" and session["metadata"] == {"case": "42"}
        sid = session["id"]
        memory = engine.session_memory[engine_id(sid)]
        assert memory is not None and memory.strategy == "tokens"
        assert dict(memory.params) == {"k": 32}

        second = await new_session(http)
        listed = (await http.get("/v1/sessions")).json()
        assert listed["object"] == "list"
        assert [s["id"] for s in listed["data"]] == [sid, second["id"]]
        assert (await http.get(f"/v1/sessions/{sid}")).json() == session

        deleted = await http.delete(f"/v1/sessions/{sid}")
        assert deleted.status_code == 200
        assert deleted.json() == {"id": sid, "object": "session.deleted", "deleted": True}
        assert engine.dropped == [engine_id(sid)]
        assert engine_id(sid) not in engine.sessions
        error_of(await http.get(f"/v1/sessions/{sid}"), 404, "session_not_found")
        error_of(await http.delete(f"/v1/sessions/{sid}"), 404, "session_not_found")
        assert [s["id"] for s in (await http.get("/v1/sessions")).json()["data"]] == [second["id"]]


async def test_create_without_a_body_uses_the_defaults(engine: FakeEngine) -> None:
    app = build(engine, default_session_ttl_seconds=120)
    async with http_client(app) as http:
        response = await http.post("/v1/sessions")
        assert response.status_code == 200, response.text
        session = response.json()
    assert session["ttl_seconds"] == 120
    # the engine's default strategy
    assert session["memory"] == {"strategy": None, "params": {}, "tier": "device"}
    assert engine.session_memory[engine_id(session["id"])] is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"memory": {"strategy": "no-such-strategy"}}, "memory.strategy"),  # engine refuses it
        ({"ttl_seconds": 10**9}, "ttl_seconds"),
        ({"ttl_seconds": 0}, "ttl_seconds"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
    ],
)
async def test_bad_session_requests_create_nothing(
    engine: FakeEngine, body: dict[str, Any], param: str
) -> None:
    app = build(engine)
    async with http_client(app) as http:
        response = await http.post("/v1/sessions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert (await http.get("/v1/sessions")).json()["data"] == []
    assert engine.sessions == set()


async def test_session_limit_per_tenant(engine: FakeEngine) -> None:
    app = build(engine, max_sessions_per_tenant=2)
    async with http_client(app) as http, http_client(app, OTHER_KEY) as other:
        first = await new_session(http)
        await new_session(http)
        error_of(await http.post("/v1/sessions", json={}), 429, "session_limit")
        assert len((await http.get("/v1/sessions")).json()["data"]) == 2
        await new_session(other)  # another tenant has its own quota
        await http.delete(f"/v1/sessions/{first['id']}")
        await new_session(http)


# --- documents --------------------------------------------------------------------------------


async def test_json_upload_is_ingested_with_progress(engine: FakeEngine) -> None:
    engine.ingest_chunk_tokens = 3
    app = build(engine)
    text = "one two three four five six seven eight nine ten"
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        doc = await upload_text(http, sid, text, name="numbers.txt")
        assert re.fullmatch(r"doc_[0-9a-f]{32}", doc["id"])
        assert doc["object"] == "session.document" and doc["session_id"] == sid
        assert doc["name"] == "numbers.txt"
        assert doc["status"] == "queued" and doc["progress"] == 0.0
        assert doc["tokens"] is None and doc["error"] is None

        events = await asyncio.wait_for(follow(http, sid, doc["id"]), 5)
        statuses = [e["status"] for e in events]
        assert statuses[-1] == "ready"
        assert statuses == sorted(statuses, key=["queued", "ingesting", "ready"].index)
        progress = [e["progress"] for e in events]
        assert progress == sorted(progress) and progress[-1] == 1.0
        assert events[-1]["tokens"] == 10

        got = (await http.get(f"/v1/sessions/{sid}/documents/{doc['id']}")).json()
        assert got == events[-1]
        assert await documents_of(http, sid) == [got]
        session = (await http.get(f"/v1/sessions/{sid}")).json()
        assert session["documents"] == 1 and session["memory_tokens"] == 10
        assert session["status"] == "ready"
        # The stream of a finished document is its state, then [DONE].
        assert await follow(http, sid, doc["id"]) == [got]
    assert engine.ingested[engine_id(sid)] == [text]


HTML = (
    b"<html><head><style>p {color: red}</style><script>var secret = 1;</script></head>"
    b"<body><h1>Annual report</h1><p>Revenue &amp; profit grew.</p></body></html>"
)


@pytest.mark.parametrize(
    ("filename", "content_type", "data", "expected"),
    [
        ("notes.txt", "text/plain", "plain café text\n".encode(), "plain café text\n"),
        ("notes.md", "text/markdown", b"# Title\n\n- item\n", "# Title\n\n- item\n"),
        ("notes.md", "application/octet-stream", b"by extension", "by extension"),
        ("page.html", "text/html", HTML, "Annual report\nRevenue & profit grew."),
        ("paper.pdf", "application/pdf", make_pdf(["Hello from a PDF"]), "Hello from a PDF"),
    ],
)
async def test_multipart_upload_of_each_type(
    engine: FakeEngine, filename: str, content_type: str, data: bytes, expected: str
) -> None:
    app = build(engine)
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        response = await http.post(
            f"/v1/sessions/{sid}/documents", files={"file": (filename, data, content_type)}
        )
        assert response.status_code == 200, response.text
        doc = response.json()
        assert doc["name"] == filename and doc["status"] == "queued"
        ready = await wait_ready(http, sid, doc["id"])
    (text,) = engine.ingested[engine_id(sid)]
    assert text.strip() == expected.strip()
    assert ready["tokens"] == len(expected.split())
    assert "secret" not in text and "color" not in text


async def test_form_name_overrides_the_file_name_and_names_are_sanitized(
    engine: FakeEngine,
) -> None:
    app = build(engine)
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        path_like = await http.post(
            f"/v1/sessions/{sid}/documents",
            files={"file": ("../../etc/passwd.txt", b"root:x:0:0", "text/plain")},
        )
        assert path_like.json()["name"] == "passwd.txt"
        named = await http.post(
            f"/v1/sessions/{sid}/documents",
            files={"file": ("upload.txt", b"body", "text/plain")},
            data={"name": "C:\\docs\\Q3\x07 report.txt"},
        )
        assert named.json()["name"] == "Q3 report.txt"
        json_named = await upload_text(http, sid, "text", name="/tmp/../x/\x1b[31mred.md")
        assert json_named["name"] == "[31mred.md"
        unnamed = await upload_text(http, sid, "text")
        assert unnamed["name"] == "untitled"


def _bad_uploads() -> list[tuple[str, dict[str, Any], int, str]]:
    return [
        (
            "invalid utf-8",
            {"files": {"file": ("a.txt", b"\xff\xfe\xfd bytes", "text/plain")}},
            400,
            "invalid_encoding",
        ),
        (
            "empty text",
            {"json": {"text": "  \n\t  ", "name": "blank.txt"}},
            400,
            "empty_document",
        ),
        (
            "empty html",
            {"files": {"file": ("a.html", b"<script>only()</script>", "text/html")}},
            400,
            "empty_document",
        ),
        (
            "unsupported type",
            {"files": {"file": ("a.png", b"\x89PNG\r\n", "image/png")}},
            415,
            "unsupported_media_type",
        ),
        (
            "unsupported extension",
            {"files": {"file": ("a.docx", b"PK\x03\x04", "application/octet-stream")}},
            415,
            "unsupported_media_type",
        ),
        (
            "raw body",
            {"content": b"just text", "headers": {"content-type": "text/plain"}},
            415,
            "unsupported_media_type",
        ),
        (
            "not a pdf",
            {"files": {"file": ("a.pdf", b"%PDF-1.7 garbage", "application/pdf")}},
            400,
            "invalid_document",
        ),
        (
            "oversized json",
            {"json": {"text": "word " * 300, "name": "big.txt"}},
            413,
            "document_too_large",
        ),
        (
            "oversized file",
            {"files": {"file": ("big.txt", b"x" * 2000, "text/plain")}},
            413,
            "document_too_large",
        ),
    ]


@pytest.mark.parametrize(
    ("label", "request_kwargs", "status", "code"),
    _bad_uploads(),
    ids=[case[0] for case in _bad_uploads()],
)
async def test_bad_uploads_change_nothing(
    engine: FakeEngine, label: str, request_kwargs: dict[str, Any], status: int, code: str
) -> None:
    app = build(engine, max_document_bytes=1000)
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        good = await upload_text(http, sid, "a good document")
        await wait_ready(http, sid, good["id"])
        before = await documents_of(http, sid)
        session_before = (await http.get(f"/v1/sessions/{sid}")).json()

        response = await http.post(f"/v1/sessions/{sid}/documents", **request_kwargs)
        error_of(response, status, code)

        assert await documents_of(http, sid) == before
        assert (await http.get(f"/v1/sessions/{sid}")).json() == session_before
    assert engine.ingested[engine_id(sid)] == ["a good document"]


async def test_missing_file_part_is_400(engine: FakeEngine) -> None:
    app = build(engine)
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        response = await http.post(
            f"/v1/sessions/{sid}/documents",
            files={"other": ("a.txt", b"x", "text/plain")},
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "file"
        assert await documents_of(http, sid) == []


async def test_document_limit_per_session(engine: FakeEngine) -> None:
    app = build(engine, max_documents_per_session=2)
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        await upload_text(http, sid, "one")
        await upload_text(http, sid, "two")
        before = await documents_of(http, sid)
        response = await http.post(f"/v1/sessions/{sid}/documents", json={"text": "three"})
        error_of(response, 429, "document_limit")
        assert [d["id"] for d in await documents_of(http, sid)] == [d["id"] for d in before]
        other = (await new_session(http))["id"]
        await upload_text(http, other, "three")


async def test_memory_limit_per_tenant(engine: FakeEngine) -> None:
    app = build(engine, max_memory_tokens_per_tenant=10)
    async with http_client(app) as http:
        first = (await new_session(http))["id"]
        second = (await new_session(http))["id"]
        doc = await upload_text(http, first, "w " * 8)
        await wait_ready(http, first, doc["id"])
        # Accepted (8 < 10) but 8 + 5 > 10: it fails as soon as its size is known.
        too_big = await upload_text(http, second, "w " * 5)
        events = await asyncio.wait_for(follow(http, second, too_big["id"]), 5)
        assert events[-1]["status"] == "failed"
        assert "memory tokens" in events[-1]["error"]
        fits = await upload_text(http, second, "w w")
        await wait_ready(http, second, fits["id"])
        assert (await http.get(f"/v1/sessions/{second}")).json()["memory_tokens"] == 2
        # Now at the limit: new documents are refused up front.
        response = await http.post(f"/v1/sessions/{first}/documents", json={"text": "more"})
        error_of(response, 429, "memory_limit")
        await http.delete(f"/v1/sessions/{first}")
        await upload_text(http, second, "more")


async def test_documents_of_a_session_are_ingested_in_order(engine: FakeEngine) -> None:
    engine.ingest_gate.clear()
    app = build(engine)
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        first = await upload_text(http, sid, "first document here")
        second = await upload_text(http, sid, "second one")
        await asyncio.wait_for(engine.ingest_started.wait(), 5)
        statuses = {d["id"]: d["status"] for d in await documents_of(http, sid)}
        assert statuses == {first["id"]: "ingesting", second["id"]: "queued"}
        assert len(engine.ingest_running) == 1
        assert (await http.get(f"/v1/sessions/{sid}")).json()["status"] == "ingesting"
        engine.ingest_gate.set()
        await wait_ready(http, sid, second["id"])
        await wait_ready(http, sid, first["id"])
    assert engine.ingested[engine_id(sid)] == ["first document here", "second one"]


async def test_a_failed_ingestion_is_reported_and_the_next_document_still_runs(
    engine: FakeEngine,
) -> None:
    engine.ingest_chunk_tokens = 1
    engine.ingest_fail_after_chunks = 2
    app = build(engine)
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        doomed = await upload_text(http, sid, "a b c d e")
        events = await asyncio.wait_for(follow(http, sid, doomed["id"]), 5)
        assert events[-1]["status"] == "failed"
        # the engine's exception text stays in the log; the document says an id for it
        assert re.fullmatch(
            r"Internal error \(request id err_[0-9a-f]{16}\)\.", events[-1]["error"]
        )
        assert events[-1]["tokens"] == 5 and events[-1]["progress"] == 0.4
        engine.ingest_fail_after_chunks = None
        ok = await upload_text(http, sid, "f g")
        await wait_ready(http, sid, ok["id"])
        session = (await http.get(f"/v1/sessions/{sid}")).json()
        assert session["memory_tokens"] == 4  # what the engine holds, partial document included


async def test_ingest_metrics_move(engine: FakeEngine) -> None:
    app = build(engine)
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        doc = await upload_text(http, sid, "one two three four five six")
        await wait_ready(http, sid, doc["id"])
        text = (await http.get("/metrics")).text
    assert "longserve:ingest_tokens_total 6.0" in text
    assert "longserve:ingest_seconds_count 1.0" in text
    assert "longserve:sessions_active 1.0" in text


# --- tenants ----------------------------------------------------------------------------------


async def test_another_tenants_session_is_404_on_every_route(engine: FakeEngine) -> None:
    app = build(engine)
    async with (
        http_client(app) as owner,
        http_client(app, OTHER_KEY) as other,
        sdk_client(app, OTHER_KEY) as other_sdk,
    ):
        sid = (await new_session(owner))["id"]
        doc = await upload_text(owner, sid, "private words")
        await wait_ready(owner, sid, doc["id"])
        base = f"/v1/sessions/{sid}"
        attempts = [
            await other.get(base),
            await other.delete(base),
            await other.get(f"{base}/documents"),
            await other.post(f"{base}/documents", json={"text": "intrusion"}),
            await other.post(
                f"{base}/documents", files={"file": ("x.txt", b"intrusion", "text/plain")}
            ),
            await other.post(f"{base}/documents", content=b"not even parsed"),
            await other.get(f"{base}/documents/{doc['id']}"),
            await other.get(f"{base}/documents/{doc['id']}", params={"stream": "true"}),
        ]
        for response in attempts:
            error_of(response, 404, "session_not_found")
        assert (await other.get("/v1/sessions")).json()["data"] == []

        with pytest.raises(openai.NotFoundError) as chat:
            await other_sdk.chat.completions.create(
                model=MODEL, messages=MESSAGES, extra_body={"session_id": sid}
            )
        assert chat.value.code == "session_not_found"
        with pytest.raises(openai.NotFoundError):
            await other_sdk.completions.create(
                model=MODEL, prompt="hi", extra_body={"session_id": sid}
            )

        # The owner's session is untouched.
        assert [d["id"] for d in await documents_of(owner, sid)] == [doc["id"]]
        assert (await owner.get(base)).json()["documents"] == 1
    assert engine.dropped == []
    assert engine.ingested[engine_id(sid)] == ["private words"]
    assert engine.calls == []


async def test_unknown_document_is_404(engine: FakeEngine) -> None:
    app = build(engine)
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        response = await http.get(f"/v1/sessions/{sid}/documents/doc_nope")
        error_of(response, 404, "document_not_found")


# --- deletion during ingestion ----------------------------------------------------------------


async def test_deleting_a_session_cancels_its_ingestion(engine: FakeEngine) -> None:
    engine.ingest_gate.clear()
    app = build(engine)
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        doc = await upload_text(http, sid, "a long document that never finishes")
        queued = await upload_text(http, sid, "waiting behind it")
        await asyncio.wait_for(engine.ingest_started.wait(), 5)
        watcher = asyncio.create_task(follow(http, sid, doc["id"]))
        await asyncio.sleep(0.05)

        response = await http.delete(f"/v1/sessions/{sid}")
        assert response.status_code == 200

        assert engine.dropped == [engine_id(sid)]
        assert engine.ingest_cancelled == {f"ingest-{doc['id']}"}
        assert engine.ingest_running == set()
        events = await asyncio.wait_for(watcher, 5)
        assert events[-1]["status"] == "failed"
        assert events[-1]["error"] == "The session was deleted."
        assert registry(app).held(tenant_of(API_KEY), sid) is None
    assert engine_id(sid) not in engine.ingested
    assert queued["status"] == "queued"


# --- chat with a session ----------------------------------------------------------------------


async def test_chat_with_a_session_after_upload(engine: FakeEngine) -> None:
    app = build(engine)
    async with http_client(app) as http, sdk_client(app) as sdk:
        sid = (await new_session(http))["id"]
        doc = await upload_text(http, sid, "the contract says ninety days")
        await wait_ready(http, sid, doc["id"])
        for _ in range(2):  # upload once, ask many times
            out = await sdk.chat.completions.create(
                model=MODEL, messages=MESSAGES, temperature=0, extra_body={"session_id": sid}
            )
            assert out.choices[0].message.content == "what does it say"
        stream = await sdk.completions.create(
            model=MODEL, prompt="and then", stream=True, extra_body={"session_id": sid}
        )
        assert "".join([c.choices[0].text async for c in stream]) == "and then"
    assert [c.session_id for c in engine.calls] == [engine_id(sid)] * 3


async def test_an_idle_session_reports_host_memory(engine: FakeEngine) -> None:
    app = build(engine)
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        other = (await new_session(http))["id"]
        engine.offloaded.add(engine_id(sid))  # what the engine does to a session left idle
        assert (await http.get(f"/v1/sessions/{sid}")).json()["memory"]["tier"] == "host"
        listed = (await http.get("/v1/sessions")).json()["data"]
        assert {s["id"]: s["memory"]["tier"] for s in listed} == {sid: "host", other: "device"}
        metrics = (await http.get("/metrics")).text
        assert "longserve:sessions_offloaded 1.0" in metrics


async def test_a_session_chat_has_one_choice(engine: FakeEngine) -> None:
    app = build(engine)
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        body = {"model": MODEL, "messages": MESSAGES, "n": 2, "session_id": sid}
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "n"
    assert engine.calls == []


async def test_two_sessions_ingest_while_a_third_chats(engine: FakeEngine) -> None:
    engine.ingest_gate.clear()
    engine.ingest_chunk_tokens = 2
    engine.ingest_delay = 0.001
    app = build(engine)
    async with http_client(app) as http, sdk_client(app) as sdk:
        ingesting = [(await new_session(http))["id"] for _ in range(2)]
        idle = (await new_session(http))["id"]
        docs = [await upload_text(http, sid, "word " * 40) for sid in ingesting]
        for _ in range(100):
            if len(engine.ingest_running) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(engine.ingest_running) == 2  # both sessions read at once

        out = await asyncio.wait_for(
            sdk.chat.completions.create(
                model=MODEL, messages=MESSAGES, temperature=0, extra_body={"session_id": idle}
            ),
            5,
        )
        assert out.choices[0].finish_reason == "stop"

        engine.ingest_gate.set()
        ready = await asyncio.gather(
            *(wait_ready(http, sid, doc["id"]) for sid, doc in zip(ingesting, docs, strict=True)),
            sdk.chat.completions.create(
                model=MODEL, messages=MESSAGES, temperature=0, extra_body={"session_id": idle}
            ),
        )
        assert [r["tokens"] for r in ready[:2]] == [40, 40]


async def test_busy_policy_wait_holds_the_chat_until_ingestion_ends(engine: FakeEngine) -> None:
    engine.ingest_gate.clear()
    app = build(engine)  # session_busy_policy defaults to "wait"
    async with http_client(app) as http, sdk_client(app) as sdk:
        sid = (await new_session(http))["id"]
        doc = await upload_text(http, sid, "being read")
        chat = asyncio.create_task(
            sdk.chat.completions.create(
                model=MODEL, messages=MESSAGES, temperature=0, extra_body={"session_id": sid}
            )
        )
        await asyncio.sleep(0.1)
        assert not chat.done()
        assert engine.calls == []
        engine.ingest_gate.set()
        out = await asyncio.wait_for(chat, 5)
        assert out.choices[0].message.content == "what does it say"
        got = (await http.get(f"/v1/sessions/{sid}/documents/{doc['id']}")).json()
        assert got["status"] == "ready"


async def test_busy_policy_reject_is_409(engine: FakeEngine) -> None:
    engine.ingest_gate.clear()
    app = build(engine, session_busy_policy="reject")
    async with http_client(app) as http, sdk_client(app) as sdk:
        sid = (await new_session(http))["id"]
        doc = await upload_text(http, sid, "being read")
        with pytest.raises(openai.ConflictError) as busy:
            await sdk.chat.completions.create(
                model=MODEL, messages=MESSAGES, extra_body={"session_id": sid}
            )
        assert busy.value.code == "session_busy"
        assert engine.calls == []
        engine.ingest_gate.set()
        await wait_ready(http, sid, doc["id"])
        await sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"session_id": sid}
        )


async def test_waiting_past_the_timeout_is_409(engine: FakeEngine) -> None:
    engine.ingest_gate.clear()
    app = build(engine, session_wait_timeout_seconds=0.05)
    async with http_client(app) as http:
        sid = (await new_session(http))["id"]
        await upload_text(http, sid, "never finishes")
        body = {"model": MODEL, "messages": MESSAGES, "session_id": sid}
        error_of(await http.post("/v1/chat/completions", json=body), 409, "session_busy")
    assert engine.calls == []


# --- TTL --------------------------------------------------------------------------------------


async def test_idle_sessions_are_evicted_after_their_ttl(engine: FakeEngine) -> None:
    app = build(engine, session_sweep_interval_seconds=0.01)
    now = [1_000_000.0]
    registry(app).clock = lambda: now[0]
    swept: list[float] = []
    sweep = registry(app).sweeper.sweep

    async def counted_sweep() -> list[str]:
        swept.append(now[0])
        return await sweep()

    registry(app).sweeper.sweep = counted_sweep  # type: ignore[method-assign]

    async def alive(http: httpx.AsyncClient, sid: str) -> bool:
        """Whether the session survives the next two sweeps (polling for up to 2 s)."""
        start = len(swept)
        for _ in range(40):
            await asyncio.sleep(0.05)
            if (await http.get(f"/v1/sessions/{sid}")).status_code == 404:
                return False
            if len(swept) >= start + 2:
                return True
        return True

    async with app.router.lifespan_context(app), http_client(app) as http, sdk_client(app) as sdk:
        short = (await new_session(http, ttl_seconds=60))["id"]
        long = (await new_session(http, ttl_seconds=600))["id"]
        busy = (await new_session(http, ttl_seconds=60))["id"]
        engine.ingest_gate.clear()
        await upload_text(http, busy, "still being read")

        now[0] += 50
        await sdk.chat.completions.create(  # using a session keeps it alive
            model=MODEL, messages=MESSAGES, extra_body={"session_id": short}
        )
        assert (await http.get(f"/v1/sessions/{short}")).json()["expires_at"] == int(now[0] + 60)
        now[0] += 50
        assert await alive(http, short)

        now[0] += 11
        assert not await alive(http, short)
        assert engine_id(short) in engine.dropped
        assert await alive(http, long)
        assert await alive(http, busy)  # reading a document is not idleness

        engine.ingest_gate.set()
        await wait_until_async(lambda: not engine.ingest_running, "the document was never read")
        now[0] += 61
        assert not await alive(http, busy)
        error_of(await http.get(f"/v1/sessions/{short}/documents"), 404, "session_not_found")
        with pytest.raises(openai.NotFoundError):
            await sdk.chat.completions.create(
                model=MODEL, messages=MESSAGES, extra_body={"session_id": short}
            )
    assert engine.shutdown_called


# --- over a real socket -----------------------------------------------------------------------


def test_upload_then_streamed_chat_waits_over_uvicorn() -> None:
    """uvicorn's own receive/disconnect plumbing: a streamed chat on a session still reading
    its document waits for it, then streams."""
    engine = FakeEngine(MODEL)
    engine.ingest_chunk_tokens = 1
    engine.ingest_delay = 0.03
    app = build_app(ServerSettings(api_keys=[API_KEY]), engine)
    server = ThreadedServer.of(app)
    server.start()
    base = server.url
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=10) as http:
            sid = http.post("/v1/sessions", json={}).json()["id"]
            upload = http.post(
                f"/v1/sessions/{sid}/documents",
                files={
                    "file": ("doc.md", b"one two three four five six seven eight", "text/markdown")
                },
            )
            assert upload.status_code == 200, upload.text
            doc_id = upload.json()["id"]
            with openai.OpenAI(
                base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=10
            ) as sdk:
                stream = sdk.chat.completions.create(
                    model=MODEL,
                    messages=MESSAGES,
                    temperature=0,
                    stream=True,
                    extra_body={"session_id": sid},
                )
                text = "".join(c.choices[0].delta.content or "" for c in stream)
            assert text == "what does it say"
            doc = http.get(f"/v1/sessions/{sid}/documents/{doc_id}").json()
            assert doc["status"] == "ready" and doc["tokens"] == 8
    finally:
        server.stop()
    assert engine.shutdown_called
