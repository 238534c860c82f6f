"""server/serving/tools.py and tool_formats.py without a model: which requests are refused, how
tools and calls are rendered for the model (longserve's own rendering, or fields for a chat
template that renders tools), how each syntax's answers become tool_calls, and how a streamed
call is held."""

from __future__ import annotations

import json

import pytest

from server.errors import APIError
from server.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCall
from server.serving.tool_formats import HERMES, LLAMA3_JSON, LONGSERVE, MISTRAL
from server.serving.tools import (
    TOOL_OPEN,
    ToolPlan,
    ToolStream,
    parse_calls,
    plan_tools,
    render_messages,
)
from server.settings import ServerSettings
from tests.server.conftest import MODEL
from tests.server.fake_engine import FakeEngine

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
        plan_tools(SETTINGS, request(**fields), None)
    assert refused.value.status_code == 400 and refused.value.param == param


def test_modes_and_grammars():
    assert plan_tools(SETTINGS, request(), None) is None
    assert plan_tools(SETTINGS, request(tools=[WEATHER], tool_choice="none"), None).grammar is None
    auto = plan_tools(SETTINGS, request(tools=[WEATHER]), None)
    assert auto.mode == "auto" and auto.grammar.type == "lark" and "TEXT" in auto.grammar.schema
    assert auto.grammar.param == "tools"
    one = plan_tools(SETTINGS, request(tools=[WEATHER], parallel_tool_calls=False), None)
    assert "calls: call\n" in one.grammar.schema
    named = plan_tools(
        SETTINGS,
        request(
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
        ),
        None,
    )
    assert named.mode == "required" and "TEXT" not in named.grammar.schema
    # parameters without additionalProperties get false: only the declared ones
    assert named.functions[0]["parameters"]["additionalProperties"] is False


def test_tools_and_calls_are_rendered_for_the_model():
    plan = plan_tools(SETTINGS, request(tools=[WEATHER]), None)
    call = ToolCall(
        id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}')
    )
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(role="assistant", tool_calls=[call]),
        ChatMessage(role="tool", tool_call_id="call_1", content="Sunny."),
    ]
    rendered = render_messages(messages, plan, LONGSERVE)
    assert rendered[0]["content"].startswith("Be brief.\n\nYou can call functions.")
    assert '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2] == {
        "role": "assistant",
        "content": '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>',
    }
    assert rendered[3] == {"role": "tool", "content": "Sunny."}
    # without a system message one is added; tool_choice none renders no tools
    assert render_messages(messages[1:2], plan, LONGSERVE)[0]["role"] == "system"
    assert len(render_messages(messages[1:2], ToolPlan("none"), LONGSERVE)) == 1


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
    plan = plan_tools(SETTINGS, request(tools=[WEATHER]), None)
    text = ToolStream(plan)
    assert [text.feed(p) for p in ["<to", "ad", " it is"]] == ["", "<toad", " it is"]
    assert text.finish() == ("", None)
    call = ToolStream(plan)
    pieces = [TOOL_OPEN, '{"name":"get_weather",', '"arguments":{"city":"Oslo"}}', "</tool_call>"]
    assert [call.feed(p) for p in pieces] == ["", "", "", ""]
    held, deltas = call.finish()
    assert held == "" and [d.function.name for d in deltas] == ["get_weather"]
    assert json.loads(deltas[0].function.arguments) == {"city": "Oslo"} and deltas[0].index == 0


def test_the_grammar_without_a_tool_template_is_unchanged():
    """The embedded model's grammar, as it was before tool formats (decision 066)."""
    plan = plan_tools(SETTINGS, request(tools=[WEATHER]), None)
    body = {
        "x-guidance": {"whitespace_flexible": False},
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {**WEATHER["function"]["parameters"], "additionalProperties": False},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    assert plan.syntax is LONGSERVE
    assert plan.grammar.schema == (
        "start: TEXT | calls\ncalls: call+\n"
        'call: "<tool_call>" body "</tool_call>"\n'
        f"body: %json {json.dumps(body)}\n"
        "TEXT: /[^<][\\s\\S]*/\n"
    )


@pytest.mark.parametrize(
    ("tool_format", "marker", "key"),
    [
        ("hermes", '"<tool_call>\\n" body "\\n</tool_call>"', '"arguments"'),
        ("llama3_json", 'call ("; " call)*', '"parameters"'),
        ("mistral", '"[TOOL_CALLS]" " "? "[" call (", " call)* "]"', '"arguments"'),
    ],
)
def test_a_tool_template_gets_its_own_syntax(tool_format, marker, key):
    plan = plan_tools(SETTINGS, request(tools=[WEATHER], tool_choice="required"), tool_format)
    assert plan.syntax.name == tool_format and marker in plan.grammar.schema
    assert key in plan.grammar.schema and '"item_separator": ", "' in plan.grammar.schema
    unplanned = plan_tools(SETTINGS, request(tools=[WEATHER], tool_choice="none"), tool_format)
    assert unplanned.grammar is None and unplanned.syntax.name == tool_format


def test_a_tool_template_gets_the_tools_and_calls_as_fields():
    plan = plan_tools(SETTINGS, request(tools=[WEATHER]), "mistral")
    call = ToolCall(
        id="abcDEF123", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}')
    )
    messages = [
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(role="assistant", tool_calls=[call]),
        ChatMessage(role="tool", tool_call_id="abcDEF123", content="Sunny."),
    ]
    rendered = render_messages(messages, plan, MISTRAL)
    assert rendered[0] == {
        "role": "user",
        "content": "Weather in Paris?",
        "tools": [
            {
                "type": "function",
                "function": WEATHER["function"]
                | {
                    "parameters": {
                        **WEATHER["function"]["parameters"],
                        "additionalProperties": False,
                    }
                },
            }
        ],
    }
    assert rendered[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "abcDEF123",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert rendered[2] == {"role": "tool", "content": "Sunny.", "tool_call_id": "abcDEF123"}
    # tool_choice none: no tools, the calls sent back still go to the template as fields
    unplanned = render_messages(messages, ToolPlan("none", syntax=MISTRAL), MISTRAL)
    assert "tools" not in unplanned[0] and unplanned[1]["tool_calls"]
    assert render_messages(messages, None, MISTRAL)[1]["tool_calls"]


@pytest.mark.parametrize(
    ("syntax", "text", "expected"),
    [
        (
            HERMES,
            '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>',
            [("a", {"x": 1})],
        ),
        (
            HERMES,
            '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"y": "z"}}\n</tool_call>',
            [("a", {}), ("b", {"y": "z"})],
        ),
        (LLAMA3_JSON, '{"name": "a", "parameters": {"x": 1}}', [("a", {"x": 1})]),
        (
            LLAMA3_JSON,
            '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"y": 2}}',
            [("a", {}), ("b", {"y": 2})],
        ),
        (MISTRAL, '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}]', [("a", {"x": 1})]),
        (
            MISTRAL,
            '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": 2}}]',
            [("a", {}), ("b", {"y": 2})],
        ),
    ],
)
def test_each_syntax_reads_its_calls(syntax, text, expected):
    calls = parse_calls(text, syntax)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
    assert len({c.id for c in calls}) == len(calls)
    if syntax is MISTRAL:  # its template refuses other ids when they are sent back
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    else:
        assert all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize(
    ("syntax", "text"),
    [
        (HERMES, "It is sunny."),
        (HERMES, '<tool_call>\n{"name": "a", "argu'),  # cut by max_tokens
        (LLAMA3_JSON, "It is sunny."),
        (LLAMA3_JSON, '{"name": "a", "parameters": {}} and then some text'),
        (LLAMA3_JSON, '{"city": "Paris"}'),  # JSON, but not a call
        (LLAMA3_JSON, '{"name": "a", "param'),
        (MISTRAL, "It is sunny."),
        (MISTRAL, '[TOOL_CALLS] {"name": "a", "arguments": {}}'),  # not an array
        (MISTRAL, '[TOOL_CALLS] [{"name": "a", "arguments": {}}'),
        (MISTRAL, '[{"name": "a", "arguments": {}}]'),  # no marker: text
        (MISTRAL, '<tool_call>{"name":"a","arguments":{}}</tool_call>'),  # another syntax
    ],
)
def test_malformed_calls_stay_text(syntax, text):
    assert parse_calls(text, syntax) is None


@pytest.mark.parametrize(
    ("tool_format", "pieces", "name"),
    [
        (
            "llama3_json",
            ['{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}'],
            "get_weather",
        ),
        (
            "mistral",
            ["[TOOL", "_CALLS] [", '{"name": "get_weather", "arguments": {}}]'],
            "get_weather",
        ),
    ],
)
def test_a_streamed_call_is_held_in_each_syntax(tool_format, pieces, name):
    plan = plan_tools(SETTINGS, request(tools=[WEATHER]), tool_format)
    call = ToolStream(plan)
    assert [call.feed(p) for p in pieces] == [""] * len(pieces)
    held, deltas = call.finish()
    assert held == "" and [d.function.name for d in deltas] == [name]
    text = ToolStream(plan)
    assert text.feed("Sunny") == "Sunny" and text.finish() == ("", None)


@pytest.fixture
def engine() -> FakeEngine:
    """A model whose chat template speaks Mistral's tool syntax (the fake echoes the last
    message, so a user message written as a call comes back as one)."""
    return FakeEngine(MODEL, tool_format="mistral")


MISTRAL_CALL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'


async def test_a_mistral_model_calls_in_openai_shape_and_gets_its_calls_back(oai, engine):
    ask = [{"role": "user", "content": MISTRAL_CALL}]
    reply = await oai.chat.completions.create(
        model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required", temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert len(call.id) == 9 and call.id.isalnum()
    [(sent, _)] = engine.prepared
    assert sent[0]["tools"][0]["function"]["name"] == "get_weather"
    assert sent[0]["content"] == MISTRAL_CALL  # the template renders it, not the server

    back = [
        {"role": "user", "content": "Weather in Paris?"},
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny."},
    ]
    answer = await oai.chat.completions.create(
        model=MODEL, messages=back, tools=[WEATHER], temperature=0
    )
    assert (
        answer.choices[0].message.content == "Sunny." and not answer.choices[0].message.tool_calls
    )
    sent = engine.prepared[-1][0]
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert sent[2] == {"role": "tool", "content": "Sunny.", "tool_call_id": call.id}


async def test_a_mistral_call_streams_as_tool_call_deltas(oai):
    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": MISTRAL_CALL}],
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        stream=True,
    )
    chunks = [c.choices[0] async for c in stream if c.choices]
    assert not "".join(c.delta.content or "" for c in chunks)
    [delta] = [d for c in chunks for d in c.delta.tool_calls or ()]
    assert delta.function.name == "get_weather" and len(delta.id) == 9
    assert json.loads(delta.function.arguments) == {"city": "Paris"}
    assert chunks[-1].finish_reason == "tool_calls"
