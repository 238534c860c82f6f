"""Errors leak nothing: no server path, errno or exception text reaches a client (a 500 says
"internal error" and an id the log has), /ready names the failing part only, and a malformed
stored-response id is a 404 like any unknown one (fake engine, real embedded store)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import pytest

from engine.protocol import EngineHealth
from memory_store.app import build_app as build_memory_service
from memory_store.backends.embedded import EmbeddedBackend
from memory_store.settings import MemoryStoreSettings
from server.app import build_app
from server.settings import ServerSettings
from tests.server.conftest import API_KEY, MODEL
from tests.server.fake_engine import FakeEngine
from tests.server.test_session_records import embedded_client, replica
from tests.server.test_sessions import error_of

SECRET = "/srv/longserve/secret-dir/[Errno 13]"
INTERNAL = re.compile(r"Internal error \(request id (err_[0-9a-f]{16})\)\.")


async def test_an_engine_failure_is_an_internal_error_with_an_id_in_the_log(
    engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    app = build_app(ServerSettings(api_keys=[API_KEY]), engine)
    engine.fail_after_tokens = 0
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "a b c"}]}
    with caplog.at_level(logging.ERROR, logger="server.error_mapping"):
        async with httpx.AsyncClient(
            transport=transport, base_url="http://t", headers=headers
        ) as http:
            response = await http.post("/v1/chat/completions", json=chat)
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "internal_server_error"
    match = INTERNAL.fullmatch(error["message"])
    assert match is not None, error["message"]
    assert "fake engine failed" not in error["message"]
    logged = [r for r in caplog.records if match.group(1) in r.getMessage()]
    assert logged and "fake engine failed" in logged[0].getMessage()


async def test_a_dead_engine_is_a_503_without_its_cause(engine: FakeEngine) -> None:
    app = build_app(ServerSettings(api_keys=[API_KEY]), engine)
    engine.dead = True
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "a b c"}]}
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers) as http:
        response = await http.post("/v1/chat/completions", json=chat)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "The engine is not available."


@pytest.mark.parametrize("fails", ["detail", "raises"])
async def test_ready_names_the_failing_part_only(engine: FakeEngine, fails: str) -> None:
    async def health() -> EngineHealth:
        if fails == "raises":
            raise RuntimeError(f"cannot open {SECRET}")
        return EngineHealth(ok=False, detail=f"engine worker died: OSError({SECRET!r})")

    engine.health = health  # type: ignore[method-assign]
    app = build_app(ServerSettings(api_keys=[API_KEY]), engine)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as http:
        ready = await http.get("/ready")  # no key: anyone may ask
    assert ready.status_code == 503
    assert ready.json() == {"status": "unavailable", "detail": "engine unavailable"}


async def test_ready_hides_why_the_store_is_down(tmp_path: Path) -> None:
    store = embedded_client(tmp_path / "s")

    async def ping() -> None:
        raise OSError(13, "Permission denied", SECRET)

    store.ping = ping  # type: ignore[method-assign]
    async with replica(store, {}) as r:
        ready = await r.http.get("/ready")
    assert ready.status_code == 503
    assert ready.json() == {"status": "unavailable", "detail": "memory store unavailable"}


@pytest.mark.parametrize("response_id", ["resp_%2A", "resp_..", "resp_a%7Bb%7D", "x" * 300])
async def test_a_malformed_response_id_is_not_found(tmp_path: Path, response_id: str) -> None:
    async with replica(embedded_client(tmp_path / "s"), {}) as r:
        error_of(await r.http.get(f"/v1/responses/{response_id}"), 404, "response_not_found")
        error_of(await r.http.delete(f"/v1/responses/{response_id}"), 404, "response_not_found")
        previous = httpx.URL(f"http://t/{response_id}").path[1:]  # the id as the route saw it
        made = await r.http.post(
            "/v1/responses",
            json={"model": MODEL, "input": "hi", "previous_response_id": previous},
        )
        error = error_of(made, 404, "response_not_found")
        assert error["param"] == "previous_response_id"


async def test_the_memory_service_hides_its_backends_failure(tmp_path: Path) -> None:
    root = tmp_path / "store"
    app = build_memory_service(MemoryStoreSettings(), backend=EmbeddedBackend(root))
    root.rmdir()
    root.write_text("not a directory")  # every write below it now fails with ENOTDIR
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://m") as http:
        put = await http.put("/v1/records/sess:abc/meta", json={"a": 1})
        ready = await http.get("/ready")
    assert put.status_code == 503, put.text
    message = put.json()["error"]["message"]
    assert str(tmp_path) not in message and "Errno" not in message, message
    assert "request id err_" in message
    assert ready.status_code in (200, 503)
    assert str(tmp_path) not in ready.text and "Errno" not in ready.text
