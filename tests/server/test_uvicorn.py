"""A real uvicorn server on a free port with the sync openai SDK: streaming arrives
incrementally, and closing the stream aborts the engine request."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from server.app import build_app
from server.settings import ServerSettings
from tests.helpers import ThreadedServer, wait_until
from tests.server.conftest import API_KEY, MODEL
from tests.server.fake_engine import FakeEngine


@pytest.fixture
def served() -> Iterator[tuple[openai.OpenAI, FakeEngine]]:
    engine = FakeEngine(MODEL, token_delay=0.01)
    app = build_app(ServerSettings(api_keys=[API_KEY]), engine)
    with (
        ThreadedServer.of(app) as server,
        openai.OpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=10
        ) as client,
    ):
        yield client, engine
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
    wait_until(lambda: request_id in engine.aborted, "the engine never saw the abort", 5)
    assert engine.running == set()
