"""server/serving/tools.py without a model: which requests are refused, how tools and calls are
rendered for the model, how answers become tool_calls, and how a streamed call is held."""

from __future__ import annotations

import json

import pytest

from server.errors import APIError
from server.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCall
from server.serving.tools import (
    TOOL_OPEN,
    ToolPlan,
    ToolStream,
    parse_calls,
    plan_tools,
    render_messages,
)
from server.settings import ServerSettings

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SETTINGS = ServerSettings()


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], **fields
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": ["auto"]}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_malformed_tools_are_refused_naming_the_field(fields, param):
    with pytest.raises(APIError) as refused:
        plan_tools(SETTINGS, request(**fields))
    assert refused.value.status_code == 400 and refused.value.param == param


def test_modes_and_grammars():
    assert plan_tools(SETTINGS, request()) is None
    assert plan_tools(SETTINGS, request(tools=[WEATHER], tool_choice="none")).grammar is None
    auto = plan_tools(SETTINGS, request(tools=[WEATHER]))
    assert auto.mode == "auto" and auto.grammar.type == "lark" and "TEXT" in auto.grammar.schema
    assert auto.grammar.param == "tools"
    one = plan_tools(SETTINGS, request(tools=[WEATHER], parallel_tool_calls=False))
    assert "calls: call\n" in one.grammar.schema
    named = plan_tools(
        SETTINGS,
        request(
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
        ),
    )
    assert named.mode == "required" and "TEXT" not in named.grammar.schema
    # parameters without additionalProperties get false: only the declared ones
    assert named.functions[0]["parameters"]["additionalProperties"] is False


def test_tools_and_calls_are_rendered_for_the_model():
    plan = plan_tools(SETTINGS, request(tools=[WEATHER]))
    call = ToolCall(
        id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}')
    )
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(role="assistant", tool_calls=[call]),
        ChatMessage(role="tool", tool_call_id="call_1", content="Sunny."),
    ]
    rendered = render_messages(messages, plan)
    assert rendered[0]["content"].startswith("Be brief.\n\nYou can call functions.")
    assert '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2] == {
        "role": "assistant",
        "content": '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>',
    }
    assert rendered[3] == {"role": "tool", "content": "Sunny."}
    # without a system message one is added; tool_choice none renders no tools
    assert render_messages(messages[1:2], plan)[0]["role"] == "system"
    assert len(render_messages(messages[1:2], ToolPlan("none"))) == 1


def test_answers_become_calls_or_stay_text():
    text = '<tool_call>{"name":"a","arguments":{"x":1}}</tool_call><tool_call>{"name":"b","arguments":{}}</tool_call>'
    calls = parse_calls(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]
    assert len({c.id for c in calls}) == 2
    assert parse_calls("It is sunny.") is None
    assert parse_calls('<tool_call>{"name":"a","argu') is None  # cut by max_tokens


def test_a_streamed_answer_is_held_only_while_it_may_be_a_call():
    plan = plan_tools(SETTINGS, request(tools=[WEATHER]))
    text = ToolStream(plan)
    assert [text.feed(p) for p in ["<to", "ad", " it is"]] == ["", "<toad", " it is"]
    assert text.finish() == ("", None)
    call = ToolStream(plan)
    pieces = [TOOL_OPEN, '{"name":"get_weather",', '"arguments":{"city":"Oslo"}}', "</tool_call>"]
    assert [call.feed(p) for p in pieces] == ["", "", "", ""]
    held, deltas = call.finish()
    assert held == "" and [d.function.name for d in deltas] == ["get_weather"]
    assert json.loads(deltas[0].function.arguments) == {"city": "Oslo"} and deltas[0].index == 0
