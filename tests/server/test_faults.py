"""Load and faults: the openai SDK's own retry rides out a 429; one request failing mid-stream
ends only its own stream (one error event, then [DONE]); a dead engine fails /ready; a client
that goes away frees its engine request within a second."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from engine.protocol import (
    EngineDead,
    EngineError,
    EngineOverloaded,
    GenerationDelta,
    MemorySpec,
    Prompt,
    SamplingParams,
)
from server.app import build_app
from server.settings import ServerSettings
from tests.helpers import ThreadedServer, wait_until
from tests.server.conftest import API_KEY, MODEL
from tests.server.fake_engine import FakeEngine, last_text

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "a b c"}]


def sse_data(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


# --- backpressure -------------------------------------------------------------------------------


class BusyEngine(FakeEngine):
    """Refuses with EngineOverloaded (as a full waiting queue does) until `free()`."""

    def __init__(self) -> None:
        super().__init__(MODEL)
        self.busy = True
        self.attempts = 0

    def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[GenerationDelta]:
        self.attempts += 1
        if self.busy:
            raise EngineOverloaded("waiting queue is full", retry_after=0.2)
        return super().generate(*args, **kwargs)


def sdk(app: Any, max_retries: int) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(
        base_url="http://test/v1", api_key=API_KEY, http_client=http, max_retries=max_retries
    )


async def test_sdk_retries_a_429_and_succeeds_once_capacity_frees() -> None:
    engine = BusyEngine()
    app = build_app(ServerSettings(api_keys=[API_KEY]), engine)
    async with sdk(app, max_retries=0) as client:
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.code == "overloaded"

    engine.attempts = 0
    asyncio.get_running_loop().call_later(0.3, setattr, engine, "busy", False)
    started = time.monotonic()
    async with sdk(app, max_retries=2) as client:
        out = await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    assert out.choices[0].message.content == "a b c"
    assert engine.attempts == 2  # refused once, then served
    assert time.monotonic() - started >= 0.9  # the SDK waited the Retry-After


# --- one request failing ------------------------------------------------------------------------


class PartlyBrokenEngine(FakeEngine):
    """Requests whose last message contains `boom` fail after one token, with `error`."""

    def __init__(self, error: Exception) -> None:
        super().__init__(MODEL, token_delay=0.01)
        self.error = error

    async def _run(
        self,
        request_id: str,
        prompt: Prompt,
        sampling: SamplingParams,
        memory: MemorySpec | None,
        session_id: str | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        if "boom" not in last_text(prompt):
            async for delta in super()._run(request_id, prompt, sampling, memory, session_id):
                yield delta
            return
        yield GenerationDelta("boom", [7], 1, 1)
        await asyncio.sleep(0.05)
        raise self.error


@pytest.mark.parametrize(
    ("error", "type_", "code"),
    [
        (EngineError("one request broke"), "internal_server_error", None),
        (RuntimeError("secret detail"), "internal_server_error", None),
        (EngineDead("the worker died"), "service_unavailable_error", "engine_dead"),
    ],
)
async def test_a_failure_ends_only_its_own_stream(
    error: Exception, type_: str, code: str | None
) -> None:
    engine = PartlyBrokenEngine(error)
    app = build_app(ServerSettings(api_keys=[API_KEY]), engine)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    words = " ".join(f"w{i}" for i in range(20))  # 20 tokens, 0.2 s: outlives the failure

    async def stream(content: str) -> list[str]:
        body = {"model": MODEL, "stream": True, "temperature": 0,
                "messages": [{"role": "user", "content": content}]}  # fmt: skip
        async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH) as c:
            response = await c.post("/v1/chat/completions", json=body)
        assert response.status_code == 200
        return sse_data(response.text)

    healthy_1, broken, healthy_2 = await asyncio.gather(
        stream(words), stream("boom"), stream(words)
    )
    assert broken[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in broken[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and "error" in json.loads(broken[-2])
    assert errors[0]["type"] == type_ and errors[0]["code"] == code
    assert "secret detail" not in errors[0]["message"]
    for events in (healthy_1, healthy_2):
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == words
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert engine.running == set()


async def test_a_fatal_engine_error_fails_ready_and_new_requests() -> None:
    engine = FakeEngine(MODEL)
    app = build_app(ServerSettings(api_keys=[API_KEY]), engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH) as http:
        assert (await http.get("/ready")).status_code == 200
        engine.dead = True  # what the real worker sets when a step raises
        ready = await http.get("/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
        assert (await http.get("/health")).status_code == 200  # alive: restart is the remedy
        body = {"model": MODEL, "messages": MESSAGES}
        for stream in (False, True):
            response = await http.post("/v1/chat/completions", json={**body, "stream": stream})
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "engine_dead"


# --- client disconnects, over a real socket -----------------------------------------------------


@pytest.fixture
def served() -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine(MODEL, token_delay=0.01)
    app = build_app(ServerSettings(api_keys=[API_KEY]), engine)
    with ThreadedServer.of(app) as server:
        yield server.url, engine


def wait_freed(engine: FakeEngine, closed_at: float) -> float:
    left = 1.0 - (time.monotonic() - closed_at)
    wait_until(
        lambda: not engine.running, "the engine request outlived its client by 1 s", left, 0.005
    )
    return time.monotonic() - closed_at


def test_a_stream_closed_by_its_client_is_freed_within_a_second(
    served: tuple[str, FakeEngine],
) -> None:
    base_url, engine = served
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 4000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
        closed_at = time.monotonic()  # the block's exit closed the connection mid-stream
    wait_freed(engine, closed_at)
    assert engine.calls[-1].request_id in engine.aborted


def test_a_waiting_client_that_hangs_up_is_freed_within_a_second(
    served: tuple[str, FakeEngine],
) -> None:
    base_url, engine = served
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "temperature": 0,
                       "max_tokens": 4000, "ignore_eos": True}).encode()  # fmt: skip
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
            + f"Authorization: Bearer {API_KEY}\r\n".encode()
            + b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: engine.running, "the request never reached the engine", 5)
    closed_at = time.monotonic()
    wait_freed(engine, closed_at)
    assert engine.calls[-1].request_id in engine.aborted
