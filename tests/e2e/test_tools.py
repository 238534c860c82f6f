"""Tool calls end to end: the official SDK (a call, its result sent back, streaming) and
langchain-openai (bind_tools, with_structured_output) against a real server with the embedded
model."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from .conftest import API_KEY

pytestmark = pytest.mark.real_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_required_call_round_trips(client, model_id):
    reply = client.chat.completions.create(
        model=model_id,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == ({"city"} if call.function.name == "get_weather" else {"timezone"})
    # the call and its result go back; the model answers in text
    follow = client.chat.completions.create(
        model=model_id,
        messages=[
            *ASK,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."},
        ],
        tools=[WEATHER, TIME],
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    assert follow.choices[0].message.content
    assert follow.choices[0].message.tool_calls is None


def test_a_named_function_is_called_and_streamed(client, model_id):
    stream = client.chat.completions.create(
        model=model_id,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert calls and {t.function.name for t in calls} == {"get_weather"}
    assert all(json.loads(t.function.arguments).keys() == {"city"} for t in calls)
    assert [t.index for t in calls] == list(range(len(calls)))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_answers_text_or_valid_calls(client, model_id):
    reply = client.chat.completions.create(
        model=model_id, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60
    )
    message = reply.choices[0].message
    if message.tool_calls:
        assert reply.choices[0].finish_reason == "tool_calls"
        assert all(json.loads(c.function.arguments).get("city") for c in message.tool_calls)
    else:
        assert message.content and not message.content.startswith("<")


def test_bad_tools_are_400s(client, model_id):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=model_id,
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert refused.value.body["param"] == "tool_choice"


class Weather(BaseModel):
    city: str
    sunny: bool


def test_langchain_bind_tools_and_structured_output(server, model_id):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "Sunny."

    llm = ChatOpenAI(
        model=model_id, base_url=server.api_base, api_key=API_KEY, temperature=0, max_tokens=60
    )
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Paris?"
    )
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert "city" in message.tool_calls[0]["args"]
    for method in ("json_schema", "function_calling"):
        answer = llm.with_structured_output(Weather, method=method).invoke(
            "Is it sunny in Paris? Answer about the city."
        )
        assert isinstance(answer, Weather), method
