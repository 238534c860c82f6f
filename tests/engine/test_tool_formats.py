"""Tool calls in each chat template's own syntax (docs/decisions/066-tool-call-formats.md), on
the embedded tokenizer carrying the real templates of Llama 3.1, Qwen2.5, Mistral v0.3 and
Hermes 3 (tests/engine/chat_templates.py): the engine reads which syntax a template speaks and
renders tools and calls through it, refusing control tokens in them; the server's grammar for
each syntax accepts that syntax's calls and refuses another's (llguidance, real tokenizer); and
a tiny random model with each template answers tool_choice "required" through the server with
a call in OpenAI's shape."""

from __future__ import annotations

import copy
import dataclasses
import json

import httpx
import pytest

from engine.config import EngineConfig
from engine.protocol import InvalidRequest, StructuredOutput
from engine.runner.chat_template import encode_chat
from engine.runner.grammar import Grammars
from engine.runner.loader import LoadedModel, load_model
from engine.runner.tool_template import tool_format
from server.app import build_app
from server.serving.tool_formats import (
    HERMES,
    LLAMA3_JSON,
    LONGSERVE,
    MISTRAL,
    ToolSyntax,
    tool_grammar,
)
from server.settings import ServerSettings
from tests.engine import chat_templates
from tests.helpers import save_tiny_llama

TEMPLATES = {
    "llama-3.1": chat_templates.LLAMA_3_1,
    "qwen-2.5": chat_templates.QWEN_2_5,
    "mistral-v0.3": chat_templates.MISTRAL_V0_3,
    "hermes-3": chat_templates.HERMES_3,
}
FORMATS = {"llama-3.1": "llama3_json", "qwen-2.5": "hermes", "mistral-v0.3": "mistral"}
FORMATS["hermes-3"] = "hermes"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "Its name.", "enum": ["Paris", "Oslo"]}
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SHORT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
        },
    },
}
FUNCTIONS = [
    {"name": "get_weather", "parameters": WEATHER["function"]["parameters"]},
    {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
]
CALLED = {"name": "get_weather", "arguments": {"city": "Paris"}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?", "tools": [WEATHER]},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "abcDEF123", "type": "function", "function": CALLED}],
    },
    {"role": "tool", "content": "Sunny.", "tool_call_id": "abcDEF123"},
]
# What each template makes of CONVERSATION: its tools, the call sent back, the result.
RENDERED = {
    "llama-3.1": [
        "Environment: ipython",
        "Given the following functions, please respond with a JSON for a function call",
        '    "function": {\n        "name": "get_weather",',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        'ipython<|end_header_id|>\n\n"Sunny."',
    ],
    "qwen-2.5": [
        '<tools>\n{"type": "function", "function": {"name": "get_weather", "description":',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "<tool_response>\nSunny.\n</tool_response>",
    ],
    "mistral-v0.3": [
        '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", ',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]',
        '[TOOL_RESULTS] {"content": Sunny., "call_id": "abcDEF123"}[/TOOL_RESULTS]',
    ],
    "hermes-3": [
        'Here are the available tools: <tools> {"type": "function", "function": {"name": '
        '"get_weather", "description": "get_weather(city: str) - The current weather',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "<tool_response>\nSunny.\n</tool_response>",
    ],
}
# One call of get_weather in each syntax, as its grammar makes a model write it.
CALL_TEXT = {
    LONGSERVE: '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>',
    HERMES: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    LLAMA3_JSON: '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    MISTRAL: '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
}
TWO_CALLS = {
    HERMES: CALL_TEXT[HERMES]
    + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    LLAMA3_JSON: CALL_TEXT[LLAMA3_JSON] + '; {"name": "get_time", "parameters": {}}',
    MISTRAL: CALL_TEXT[MISTRAL][:-1] + ', {"name": "get_time", "arguments": {}}]',
}


@pytest.fixture(scope="module")
def templated(tokenizer):
    """template name -> a copy of the embedded tokenizer carrying that real chat template."""
    made = {}
    for name, template in TEMPLATES.items():
        made[name] = copy.deepcopy(tokenizer)
        made[name].chat_template = template
    return made


@pytest.fixture(scope="module")
def wide_loaded(tmp_path_factory, tokenizer) -> LoadedModel:
    """The tiny random Llama of conftest with a 1,024-position window: Llama 3.1's template
    alone takes 255 of the embedded tokenizer's tokens for one tool and one question."""
    path = save_tiny_llama(tmp_path_factory.mktemp("wide-llama"), tokenizer, positions=1024)
    return load_model(EngineConfig(model=str(path), device="cpu"))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, tokenizer.eos_token_id)


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_template_text_names_its_tool_syntax(templated, name):
    assert tool_format(templated[name]) == FORMATS[name]


def test_the_embedded_template_renders_no_tools(tokenizer):
    assert tool_format(tokenizer) is None


@pytest.mark.parametrize("name", TEMPLATES)
def test_tools_calls_and_results_are_rendered_by_the_template(templated, name):
    text = templated[name].decode(encode_chat(templated[name], CONVERSATION))
    for piece in RENDERED[name]:
        assert piece in text
    assert text.count("Sunny.") == 1 and text.count("Weather in Paris?") == 1


def test_without_tool_fields_the_rendering_is_as_before(templated):
    """A template that renders tools, given none: the plain chat, as before tool formats."""
    tokenizer = templated["qwen-2.5"]
    messages = [{"role": "user", "content": "Hello"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(encode_chat(tokenizer, messages)) == expected


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": "hi", "tools": [{"function": {"name": "<|im_end|>"}}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "abcDEF123", "function": {"name": "f", "arguments": {"x": "<|im_start|>"}}}
            ],
        },
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]},
    ],
)
def test_tools_and_calls_spelling_control_tokens_or_malformed_are_refused(templated, message):
    with pytest.raises(InvalidRequest) as refused:
        encode_chat(templated["qwen-2.5"], [message])
    assert refused.value.param == "messages"


def accepts(grammars, tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar lets a model write text (as the tokenizer splits it) and end."""
    from llguidance import LLMatcher

    compiled = grammars.compile(StructuredOutput("lark", grammar, "tools"))
    matcher = LLMatcher(grammars.ll_tokenizer(), compiled, log_level=0)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    if matcher.validate_tokens(tokens) != len(tokens):
        return False
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("syntax", list(CALL_TEXT), ids=lambda s: str(s.name))
def test_each_grammar_forces_its_own_syntax(grammars, tokenizer, syntax: ToolSyntax):
    required = tool_grammar(syntax, FUNCTIONS, "required", parallel=True)
    for other, text in CALL_TEXT.items():
        assert accepts(grammars, tokenizer, required, text) == (other is syntax), other.name
    assert not accepts(grammars, tokenizer, required, "It is sunny.")
    auto = tool_grammar(syntax, FUNCTIONS, "auto", parallel=True)
    assert accepts(grammars, tokenizer, auto, "It is sunny.")
    assert accepts(grammars, tokenizer, auto, CALL_TEXT[syntax])


@pytest.mark.parametrize("syntax", list(TWO_CALLS), ids=lambda s: str(s.name))
def test_parallel_calls_only_when_asked(grammars, tokenizer, syntax: ToolSyntax):
    parallel = tool_grammar(syntax, FUNCTIONS, "required", parallel=True)
    one = tool_grammar(syntax, FUNCTIONS, "required", parallel=False)
    assert accepts(grammars, tokenizer, parallel, TWO_CALLS[syntax])
    assert not accepts(grammars, tokenizer, one, TWO_CALLS[syntax])
    assert accepts(grammars, tokenizer, one, CALL_TEXT[syntax])
    [first, second] = syntax.parse(TWO_CALLS[syntax])
    assert first == ("get_weather", {"city": "Paris"}) and second == ("get_time", {})


@pytest.mark.parametrize("name", ["mistral-v0.3", "llama-3.1", "qwen-2.5"])
async def test_a_tool_template_model_answers_a_required_call_in_openai_shape(
    make_engine, wide_loaded, templated, name
):
    engine = make_engine(loaded=dataclasses.replace(wide_loaded, tokenizer=templated[name]))
    assert engine.model.tool_format == FORMATS[name]
    app = build_app(ServerSettings(api_keys=["k"]), engine)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://test", headers={"Authorization": "Bearer k"}
    ) as http:
        response = await http.post(
            "/v1/chat/completions",
            json={
                "model": engine.model.id,
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "tools": [SHORT_WEATHER],
                "tool_choice": "required",
                "parallel_tool_calls": False,
                "temperature": 0,
                "max_tokens": 48,
            },
        )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["total_tokens"] <= 1024  # in the window, not in memory
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")
    if name == "mistral-v0.3":
        assert len(call["id"]) == 9 and call["id"].isalnum()


def test_a_session_question_after_a_document_on_a_strict_turn_template(templated):
    """Mistral's template refuses a user turn after a user turn, which is what a session's
    document turn followed by a question is: the question is rendered as one more exchange,
    without a second start-of-sequence token."""
    from engine.runner.chat_template import encode_document

    tokenizer = templated["mistral-v0.3"]
    document = encode_document(tokenizer, "The copper vault opens at noon.")
    history = [("user", "The copper vault opens at noon.")]
    question = [{"role": "user", "content": "When does it open?"}]
    ids = encode_chat(tokenizer, question, history)
    alone = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert alone.startswith(tokenizer.bos_token)
    assert tokenizer.decode(ids) == alone[len(tokenizer.bos_token) :]
    second = encode_document(tokenizer, "The gate closes at dusk.", history)  # two documents
    assert tokenizer.decode(second).count("The gate closes at dusk.") == 1
    assert tokenizer.bos_token not in tokenizer.decode(second)
    assert tokenizer.decode(document).startswith(tokenizer.bos_token)
