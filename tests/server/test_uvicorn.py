"""A real uvicorn server on a free port with the sync openai SDK: streaming arrives
incrementally, and closing the stream aborts the engine request."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import uvicorn

from server.app import build_app
from server.settings import ServerSettings
from tests.server.conftest import API_KEY, MODEL
from tests.server.fake_engine import FakeEngine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def served() -> Iterator[tuple[openai.OpenAI, FakeEngine]]:
    engine = FakeEngine(MODEL, token_delay=0.01)
    app = build_app(ServerSettings(api_keys=[API_KEY]), engine)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=10
    )
    try:
        yield client, engine
    finally:
        client.close()
        server.should_exit = True
        thread.join(timeout=10)
    assert engine.shutdown_called


def test_sdk_stream_and_close_aborts(served: tuple[openai.OpenAI, FakeEngine]) -> None:
    client, engine = served
    messages = [{"role": "user", "content": "one two three"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert out.choices[0].message.content == "one two three"

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=1000,
        extra_body={"ignore_eos": True},
        stream=True,
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    stream.close()
    request_id = engine.calls[-1].request_id
    deadline = time.monotonic() + 5
    while request_id not in engine.aborted:
        assert time.monotonic() < deadline, "the engine never saw the abort"
        time.sleep(0.02)
    assert engine.running == set()
