"""Tool calls: OpenAI's `tools` / `tool_choice` rendered into the prompt, constrained while
decoding, and parsed back into `tool_calls`, in the syntax the model's chat template speaks
(server/serving/tool_formats.py; docs/decisions/066-tool-call-formats.md).

A template that renders tools (Llama 3.1, Qwen2.5, Mistral, Hermes: the engine's
ModelInfo.tool_format) gets them as they are: the tools ride on the first message, an
assistant's calls as `tool_calls`, a tool's result with its `tool_call_id`, and the engine's
template renders them. A template without tools (the embedded model's) gets longserve's own
rendering, in the Hermes/Qwen convention small models have seen: a system message lists the
functions as JSON inside <tools></tools> and asks for `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks; an assistant message's calls are sent back as those
blocks, and a tool's result as a `tool` message. Either way the answer is constrained by a
grammar of that syntax (engine/runner/grammar.py):

    tool_choice "required" / a named function    one or more calls (one if parallel_tool_calls
                                                  is false), arguments valid for the function
    tool_choice "auto" (the default with tools)   text that does not start as a call does, or
                                                  calls
    tool_choice "none"                            free text; the tools are not rendered

A function's parameters without `additionalProperties` get `false`: the arguments carry the
declared parameters only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.protocol import StructuredOutput, ToolFormat
from server.errors import invalid_request
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from server.serving.tool_formats import LONGSERVE, ToolSyntax, syntax_of, tool_grammar
from server.settings import ServerSettings

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
Mode = Literal["none", "auto", "required"]
MODES: dict[Any, Mode] = {"none": "none", "auto": "auto", "required": "required"}
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
PREAMBLE = (
    "You can call functions. Each one is described below as JSON:\n<tools>\n{tools}\n</tools>\n"
    "To call functions, answer only with one block per call, each holding a JSON object with "
    "the function's name and its arguments:\n"
    '<tool_call>{{"name": "<function name>", "arguments": {{<its arguments>}}}}</tool_call>'
)
_FUNCTION_KEYS = ("name", "description", "parameters")  # a function's fields, in OpenAI's order


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools make of it: the mode, its functions, the grammar, and the
    syntax calls are written in."""

    mode: Mode
    functions: list[dict[str, Any]] = field(default_factory=list)  # name, description, parameters
    grammar: StructuredOutput | None = None
    syntax: ToolSyntax = LONGSERVE


def plan_tools(
    settings: ServerSettings, request: ChatCompletionRequest, tool_format: ToolFormat | None
) -> ToolPlan | None:
    """The request's ToolPlan for a model whose template speaks tool_format (None: none), or
    None without tools; 400s for malformed tools or choices."""
    if not request.tools:
        if request.tool_choice not in (None, "none"):
            raise invalid_request("tool_choice needs tools.", param="tool_choice")
        return None
    _check_tools_size(settings, request.tools)
    functions = [_function(settings, i, tool) for i, tool in enumerate(request.tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise invalid_request("tools: function names must be unique.", param="tools")
    choice = "auto" if request.tool_choice is None else request.tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or name not in names:
            raise invalid_request(
                "tool_choice must name one of the tools' functions.", param="tool_choice"
            )
        functions = [f for f in functions if f["name"] == name]
        mode: Mode = "required"
    elif isinstance(choice, str) and choice in MODES:
        mode = MODES[choice]
    else:
        raise invalid_request(
            "tool_choice must be none, auto, required or a named function.", param="tool_choice"
        )
    syntax = syntax_of(tool_format)
    if mode == "none":
        return ToolPlan("none", syntax=syntax)
    if request.response_format is not None and request.response_format.type != "text":
        raise invalid_request(
            "response_format with tools needs tool_choice none.", param="response_format"
        )
    parallel = request.parallel_tool_calls is not False
    grammar = StructuredOutput("lark", tool_grammar(syntax, functions, mode, parallel), "tools")
    return ToolPlan(mode, functions, grammar, syntax)


def _check_tools_size(settings: ServerSettings, tools: list[Any]) -> None:
    """At most max_tools tools (OpenAI's limit: 128), and max_tools_bytes of JSON in all:
    they are rendered into every prompt and stored with every response."""
    if len(tools) > settings.max_tools:
        raise invalid_request(
            f"tools: at most {settings.max_tools} tools are allowed, got {len(tools)}.",
            param="tools",
        )
    size = 0
    for tool in tools:
        size += len(json.dumps(tool, ensure_ascii=False).encode())
        if size > settings.max_tools_bytes:
            raise invalid_request(
                f"tools: their JSON is over {settings.max_tools_bytes} bytes in all.",
                param="tools",
            )


def _function(settings: ServerSettings, index: int, tool: Any) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(function, dict)
    ):
        raise invalid_request(f"tools[{index}] must be a function tool.", param="tools")
    name, parameters = function.get("name"), function.get("parameters")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid_request(
            f"tools[{index}].function.name must be 1-64 letters, digits, _ or -.", param="tools"
        )
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise invalid_request(f"tools[{index}].function.parameters must be an object.", "tools")
    if parameters.get("type") == "object" and "additionalProperties" not in parameters:
        # arguments carry the declared parameters only: a small model left free to add
        # properties adds them until max_tokens
        parameters = {**parameters, "additionalProperties": False}
    if len(json.dumps(parameters)) > settings.max_schema_bytes:
        raise invalid_request(
            f"tools[{index}]: parameters are over {settings.max_schema_bytes} bytes.", "tools"
        )
    out = {"name": name, "parameters": parameters}
    if isinstance(function.get("description"), str):
        out["description"] = function["description"]
    return out


def render_messages(
    messages: list[ChatMessage], plan: ToolPlan | None, syntax: ToolSyntax
) -> list[dict[str, Any]]:
    """The engine's chat messages, for a model whose calls are written in syntax: for its
    template's own rendering, or longserve's (tools in a system message, calls as
    <tool_call> blocks, tool results as `tool` messages); tools unless tool_choice is none."""
    if syntax.by_template:
        return _template_messages(messages, plan)
    rendered = [{"role": m.role, "content": message_text(m)} for m in messages]
    for out, message in zip(rendered, messages, strict=True):
        if message.name:
            out["name"] = message.name
    if plan is None or plan.mode == "none":
        return rendered
    tools = "\n".join(json.dumps(f, ensure_ascii=False) for f in plan.functions)
    preamble = PREAMBLE.format(tools=tools)
    if rendered and rendered[0]["role"] in ("system", "developer"):
        rendered[0]["content"] = f"{rendered[0]['content']}\n\n{preamble}"
    else:
        rendered.insert(0, {"role": "system", "content": preamble})
    return rendered


def _template_messages(messages: list[ChatMessage], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """Messages as a tool-rendering template reads them: OpenAI's fields, the calls'
    arguments as objects, and the functions on the first message as `tools`."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        out: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name:
            out["name"] = message.name
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments(call)},
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        rendered.append(out)
    if plan is not None and plan.mode != "none" and rendered:
        rendered[0]["tools"] = [
            {"type": "function", "function": {k: f[k] for k in _FUNCTION_KEYS if k in f}}
            for f in plan.functions
        ]
    return rendered


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        raise invalid_request(
            f"tool call {call.id}: arguments are not JSON.", param="messages"
        ) from None


def message_text(message: ChatMessage) -> str:
    """A message's text as the model reads it; an assistant's calls as <tool_call> blocks,
    written as the grammar makes the model write them."""
    text = message.text()
    for call in message.tool_calls or ():
        body = compact({"name": call.function.name, "arguments": _arguments(call)})
        text += f"{TOOL_OPEN}{body}{TOOL_CLOSE}"
    return text


def compact(value: Any) -> str:
    """JSON as the grammar makes the model write it: no spaces, characters as they are."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def parse_calls(text: str, syntax: ToolSyntax = LONGSERVE) -> list[ToolCall] | None:
    """The calls an answer made in syntax (it starts as a call does), or None for text."""
    calls = syntax.parse(text)
    if calls is None:
        return None
    return [
        ToolCall(id=syntax.new_id(), function=FunctionCall(name=name, arguments=compact(args)))
        for name, args in calls
    ]


class ToolStream:
    """One streamed choice with tools: text passes through once it cannot be a call; a
    call is held until the answer ends, then sent as delta.tool_calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self._syntax = plan.syntax
        self._held = ""
        self._text = plan.mode == "none"  # decided: the answer is text
        self.calls: list[ToolCall] | None = None  # the calls, once `finish` parsed them

    def feed(self, text: str) -> str:
        """The content to send now for this piece of the answer."""
        if self._text:
            return text
        self._held += text
        opening = self._syntax.opening
        if opening.startswith(self._held) or self._held.startswith(opening):
            return ""
        self._text = True
        held, self._held = self._held, ""
        return held

    def finish(self) -> tuple[str, list[DeltaToolCall] | None]:
        """At the end: content still held, or the calls (kept in `calls`) as stream deltas."""
        self.calls = calls = parse_calls(self._held, self._syntax) if self._held else None
        held, self._held = self._held, ""
        if calls is None:
            return held, None
        return "", [
            DeltaToolCall(
                index=i,
                id=call.id,
                type="function",
                function=DeltaFunctionCall(
                    name=call.function.name, arguments=call.function.arguments
                ),
            )
            for i, call in enumerate(calls)
        ]
