"""HTTP-level behaviour: error shapes, limits, auth, SSE framing, disconnects, health."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from server.app import build_app
from server.auth import tenant_session_id
from server.settings import ServerSettings, tenant_of
from tests.server.conftest import API_KEY, MODEL
from tests.server.fake_engine import FakeEngine

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "a b c d"}]}


def assert_openai_error(response: httpx.Response, status: int, type_: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if type_ is not None:
        assert error["type"] == type_
    return error


def sse_data(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs
        ({"n": 0}, "n"),
        ({"n": 9}, "n"),  # over max_n
        ({"max_tokens": 5000}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stop": ["a"] * 9}, "stop"),
        ({"stop": 5}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": None}, "model"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools"),  # only function tools
    ],
)
async def test_chat_validation_errors(
    client: httpx.AsyncClient, patch: dict, param: str, engine: FakeEngine
) -> None:
    body = {**CHAT, **patch}
    response = await client.post("/v1/chat/completions", json=body)
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert error["param"] == param
    assert engine.calls == []


async def test_missing_field_names_it(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json={"model": MODEL})
    assert assert_openai_error(response, 400)["param"] == "messages"


async def test_invalid_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 400, "invalid_request_error")


async def test_unknown_fields_are_ignored(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json={**CHAT, "frobnicate": 1})
    assert response.status_code == 200


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"logprobs": 21}, "logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "x"}, "suffix"),
    ],
)
async def test_completion_validation_errors(
    client: httpx.AsyncClient, patch: dict, param: str
) -> None:
    body = {"model": MODEL, "prompt": "a b", **patch}
    response = await client.post("/v1/completions", json=body)
    assert assert_openai_error(response, 400)["param"] == param


async def test_engine_invalid_request_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions", json={**CHAT, "memory": {"strategy": "bogus"}}
    )
    assert assert_openai_error(response, 400)["param"] == "memory.strategy"


async def test_prompt_over_limit_is_400(engine: FakeEngine) -> None:
    app = build_app(ServerSettings(max_prompt_tokens=5), engine)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as http:
        ok = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a b c"})
        assert ok.status_code == 200
        long = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a " * 10})
    error = assert_openai_error(long, 400)
    assert error["code"] == "context_length_exceeded"


# --- models, auth, routes ---------------------------------------------------------------------


async def test_unknown_model_404(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json={**CHAT, "model": "x"})
    error = assert_openai_error(response, 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"


@pytest.mark.parametrize("header", [None, "Bearer nope", "Basic abc", "Bearer"])
async def test_bad_or_missing_key_401(client: httpx.AsyncClient, header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    client.headers.pop("Authorization")
    response = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    error = assert_openai_error(response, 401, "authentication_error")
    assert error["code"] == "invalid_api_key"


async def test_auth_is_checked_before_the_body(client: httpx.AsyncClient) -> None:
    client.headers.pop("Authorization")
    response = await client.post("/v1/chat/completions", json={"model": 5})
    assert_openai_error(response, 401, "authentication_error")


async def test_tenants_do_not_see_each_others_sessions(engine: FakeEngine) -> None:
    app = build_app(ServerSettings(api_keys=["key-a", "key-b"]), engine)
    await engine.create_session(tenant_session_id(tenant_of("key-a"), "s1"))
    body = {**CHAT, "session_id": "s1"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as http:
        own = await http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-a"}
        )
        other = await http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-b"}
        )
    assert own.status_code == 200
    assert assert_openai_error(other, 404)["param"] == "session_id"


async def test_no_keys_configured_means_open_loopback(engine: FakeEngine) -> None:
    app = build_app(ServerSettings(), engine)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as http:
        assert (await http.get("/v1/models")).status_code == 200


async def test_unknown_route_is_json_404(client: httpx.AsyncClient) -> None:
    assert_openai_error(await client.get("/v1/nothing"), 404)


async def test_wrong_method_is_json_405(client: httpx.AsyncClient) -> None:
    assert_openai_error(await client.get("/v1/chat/completions"), 405)


async def test_unexpected_error_is_json_500(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("kaboom")

    engine.generate = broken  # type: ignore[method-assign]
    error = assert_openai_error(await client.post("/v1/chat/completions", json=CHAT), 500)
    assert "kaboom" not in error["message"]


async def test_overloaded_429_with_retry_after(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.overloaded = True
    for stream in (False, True):
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert_openai_error(response, 429, "rate_limit_error")
        assert response.headers["Retry-After"] == "3"


async def test_dead_engine_503(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.dead = True
    assert_openai_error(
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 503
    )


# --- body size --------------------------------------------------------------------------------


async def test_oversized_body_413(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}
    response = await client.post("/v1/chat/completions", json=body)
    assert_openai_error(response, 413)
    assert engine.calls == []


async def test_oversized_chunked_body_413(client: httpx.AsyncClient) -> None:
    async def chunks() -> Any:
        yield b'{"model": "fake-model", "messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"y" * 8192
        yield b'"}]}'

    response = await client.post(
        "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 413)


# --- streaming --------------------------------------------------------------------------------


async def test_stream_framing(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "data: [DONE]\n\n" in response.text
    events = sse_data(response.text)
    assert events[-1] == "[DONE]"
    first = json.loads(events[0])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in first


async def test_failure_mid_stream_sends_error_then_done(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.fail_after_tokens = 2
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200
    events = sse_data(response.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "internal_server_error"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert text == "a b"
    assert sum("error" in json.loads(e) for e in events[:-1]) == 1


async def test_failure_without_stream_is_500(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.fail_after_tokens = 2
    assert_openai_error(await client.post("/v1/chat/completions", json=CHAT), 500)
    assert engine.running == set()


async def _call_asgi(
    app: FastAPI, path: str, body: dict, disconnect: asyncio.Event, sent: list[dict]
) -> None:
    data = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 50000),
        "server": ("test", 80),
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            (b"authorization", f"Bearer {API_KEY}".encode()),
        ],
    }
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), timeout=10)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_disconnect_mid_stream_aborts_engine(path: str) -> None:
    engine = FakeEngine(MODEL, token_delay=0.02)
    app = build_app(ServerSettings(api_keys=[API_KEY]), engine)
    body: dict = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 500,
        "ignore_eos": True,
        "temperature": 0,
        "n": 2,
    }
    body |= {"messages": CHAT["messages"]} if "chat" in path else {"prompt": "a b c"}
    disconnect = asyncio.Event()
    sent: list[dict] = []
    call = asyncio.create_task(_call_asgi(app, path, body, disconnect, sent))
    while sum(1 for m in sent if m.get("body")) < 3:
        await asyncio.sleep(0.01)
    disconnect.set()
    await call
    assert len(engine.calls) == 2
    assert engine.aborted == {c.request_id for c in engine.calls}
    assert engine.running == set()
    assert not any(b"[DONE]" in m.get("body", b"") for m in sent)


async def test_disconnect_while_waiting_aborts_engine() -> None:
    engine = FakeEngine(MODEL, token_delay=0.02)
    app = build_app(ServerSettings(api_keys=[API_KEY]), engine)
    body = {**CHAT, "max_tokens": 500, "ignore_eos": True, "temperature": 0}
    disconnect = asyncio.Event()
    call = asyncio.create_task(_call_asgi(app, "/v1/chat/completions", body, disconnect, []))
    await asyncio.wait_for(engine.first_token_sent.wait(), 5)
    disconnect.set()
    await call
    assert engine.aborted == {engine.calls[0].request_id}
    assert engine.running == set()


async def test_finished_requests_are_not_aborted(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    await client.post("/v1/chat/completions", json={**CHAT, "stream": True, "n": 3})
    await client.post("/v1/chat/completions", json=CHAT)
    assert engine.aborted == set()
    assert len(engine.finished) == 4


# --- health -----------------------------------------------------------------------------------


async def test_health_and_ready(engine: FakeEngine) -> None:
    app = build_app(ServerSettings(api_keys=[API_KEY]), engine)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as http:  # no key: both are public
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/ready")).status_code == 200
        engine.dead = True
        assert (await http.get("/health")).status_code == 200
        ready = await http.get("/ready")
        assert ready.status_code == 503 and ready.json()["detail"] == "engine unavailable"


async def test_lifespan_shuts_engine_down(engine: FakeEngine) -> None:
    app = build_app(ServerSettings(), engine)
    async with app.router.lifespan_context(app):
        assert not engine.shutdown_called
    assert engine.shutdown_called
