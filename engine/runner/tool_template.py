"""What a chat template that renders tools is given, and which tool-call syntax it speaks.

The tools, an assistant's calls and a tool result's call id reach the template as its own
fields (OpenAI's shapes, arguments as objects), not as placeholders: the template writes them
as its own text, where control tokens are recognised, so ones that spell a special token are
refused (docs/decisions/066-tool-call-formats.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine.protocol import InvalidRequest, ToolFormat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_TOOLS_VARIABLE = re.compile(r"\btools\b")


def tool_format(tokenizer: PreTrainedTokenizerBase) -> ToolFormat | None:
    """The tool-call syntax the chat template renders tools in, read from its text (a named
    template set's "tool_use" one, as transformers picks it when tools are given): None when
    it renders no `tools` variable, or calls in a syntax longserve does not parse."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("tool_use", template.get("default"))
    if not isinstance(template, str) or not _TOOLS_VARIABLE.search(template):
        return None
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template and '"parameters"' in template:
        return "llama3_json"
    return None


def _control_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The texts the tokenizer reads as special tokens."""
    special = [
        str(token.content)
        for token in tokenizer.added_tokens_decoder.values()
        if getattr(token, "special", False)
    ]
    return [*special, *tokenizer.all_special_tokens]


def _checked(tokenizer: PreTrainedTokenizerBase, value: Any, what: str) -> Any:
    """value, unless its JSON spells a control token (the template writes it as its own text,
    where control tokens are recognised); InvalidRequest then."""
    text = json.dumps(value, ensure_ascii=False)
    for token in _control_texts(tokenizer):
        if token and token in text:
            raise InvalidRequest(f"{what} must not contain {token!r}", param="messages")
    return value


def tool_fields(
    tokenizer: PreTrainedTokenizerBase, message: Mapping[str, Any], index: int
) -> dict[str, Any]:
    """An assistant message's `tool_calls` and a tool message's `tool_call_id`, as the
    template reads them (arguments an object); {} for a message without them."""
    fields: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls:
        bad = InvalidRequest(
            f"message {index}: tool_calls must be a list of function calls", param="messages"
        )
        if not isinstance(calls, Sequence) or isinstance(calls, str):
            raise bad
        templated = []
        for call in calls:
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise bad
            if not isinstance(function.get("arguments"), Mapping):
                raise bad
            templated.append(
                {
                    "id": str(call.get("id", "")),
                    "type": "function",
                    "function": {"name": function["name"], "arguments": function["arguments"]},
                }
            )
        fields["tool_calls"] = _checked(tokenizer, templated, f"message {index}: tool_calls")
    call_id = message.get("tool_call_id")
    if isinstance(call_id, str):
        fields["tool_call_id"] = _checked(tokenizer, call_id, f"message {index}: tool_call_id")
    return fields


def template_tools(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Any]
) -> list[dict[str, Any]] | None:
    """The tools the first message carries for the template, or None."""
    first = messages[0] if messages else None
    tools = first.get("tools") if isinstance(first, Mapping) else None
    if tools is None:
        return None
    if not isinstance(tools, Sequence) or not all(isinstance(t, Mapping) for t in tools):
        raise InvalidRequest("tools must be a list of objects", param="messages")
    return _checked(tokenizer, [dict(tool) for tool in tools], "tools")
