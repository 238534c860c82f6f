"""Prompts are prepared by the engine once per request (not per choice), counted with the
tools they render, and tools are bounded in number and size (docs/decisions/057)."""

from __future__ import annotations

from typing import Any

import pytest

from server.app import build_app
from server.settings import ServerSettings
from tests.server.conftest import API_KEY, MODEL, asgi_client
from tests.server.fake_engine import FakeEngine


def _tool(name: str, description: str = "") -> dict[str, Any]:
    function = {"name": name, "parameters": {"type": "object", "properties": {}}}
    return {"type": "function", "function": {**function, "description": description}}


async def _post(settings: ServerSettings, engine: FakeEngine, path: str, body: dict) -> Any:
    async with asgi_client(build_app(settings, engine)) as http:
        return await http.post(path, json={"model": MODEL, **body})


def _settings(**limits: Any) -> ServerSettings:
    return ServerSettings(api_keys=[API_KEY], max_body_bytes=4 * 1024 * 1024, **limits)


async def test_n_choices_share_one_prepared_prompt() -> None:
    engine = FakeEngine(MODEL)
    chat = {"messages": [{"role": "user", "content": "four answers please"}], "n": 4}
    response = await _post(_settings(), engine, "/v1/chat/completions", chat)
    assert response.status_code == 200 and len(response.json()["choices"]) == 4
    assert len(engine.prepared) == 1 and len(engine.calls) == 4
    assert all(call.prompt == engine.prepared[0][0] for call in engine.calls)

    engine = FakeEngine(MODEL)
    completion = {"prompt": ["one prompt", "another prompt"], "n": 3}
    response = await _post(_settings(), engine, "/v1/completions", completion)
    assert response.status_code == 200 and len(response.json()["choices"]) == 6
    assert [prompt for prompt, _ in engine.prepared] == ["one prompt", "another prompt"]
    assert len(engine.calls) == 6


async def test_tool_descriptions_count_in_the_prompt_limit() -> None:
    engine = FakeEngine(MODEL)
    tools = [_tool("lookup", "word " * 500)]
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    response = await _post(_settings(max_prompt_tokens=100), engine, "/v1/chat/completions", chat)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert engine.calls == []  # nothing reached generation
    response = await _post(_settings(max_prompt_tokens=100), engine, "/v1/responses", {
        "input": "hi", "tools": [{"type": "function", **tools[0]["function"]}]
    })  # fmt: skip
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"


@pytest.mark.parametrize(
    ("tools", "limit"),
    [
        ([_tool(f"f{i}") for i in range(129)], "128 tools"),
        ([_tool("big", "x" * 300_000)], "262144 bytes"),
        ([_tool(f"f{i}", "y" * 3000) for i in range(100)], "262144 bytes"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_tools_are_bounded_in_number_and_size(tools, limit, path) -> None:
    engine = FakeEngine(MODEL)
    if path == "/v1/responses":
        body = {"input": "hi", "tools": [{"type": "function", **t["function"]} for t in tools]}
    else:
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    response = await _post(_settings(), engine, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and limit in error["message"]
    assert error["type"] == "invalid_request_error"
    assert engine.calls == [] and engine.prepared == []


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "word " * 200}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "w " * 200}]},
            "messages",
        ),
        ("/tokenize", {"prompt": "word " * 200}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "w " * 200}]}, "messages"),
    ],
)
async def test_the_engine_stops_counting_at_the_limit(path, body, param) -> None:
    """The server hands its limit to the engine's tokenization, which stops past it (a 24 MB
    prompt is not tokenized whole to be refused): a 400 naming the parameter."""
    engine = FakeEngine(MODEL)
    response = await _post(_settings(max_prompt_tokens=100), engine, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param
    assert "more than 100 tokens" in error["message"] and engine.calls == []
