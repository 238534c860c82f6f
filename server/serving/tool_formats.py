"""Tool-call syntaxes: how calls are written (the grammar that forces them) and read back.

One `ToolSyntax` per way a model writes calls. `LONGSERVE` is the server's own, for a chat
template that renders no tools (the embedded SmolLM2): Hermes-style <tool_call> blocks of
compact JSON, which the server renders into the prompt itself (server/serving/tools.py). The
others follow a template that renders tools (engine/protocol `ToolFormat`, detected by the
engine at load); the template renders the tools and the calls sent back, and the grammar
forces what the template shows the model, JSON spaced as its `tojson` writes it:

    hermes       <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>  (one per call,
                 newline between; Qwen2.5, Hermes 2/3)
    llama3_json  {"name": ..., "parameters": {...}}  ("; " between; Llama 3.1-3.3)
    mistral      [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]  (Mistral v0.3, Nemo)

Markers that are special tokens in a real model's vocabulary (Llama's <|python_tag|>,
Mistral's [TOOL_CALLS]) are forced as text: the grammar names no token ids
(docs/decisions/066-tool-call-formats.md).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.protocol import ToolFormat
from server.serving.schemas import bounded_numbers

Call = tuple[str, Any]
"""One call read from an answer: (function name, its arguments as JSON values)."""

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_ID = string.ascii_letters + string.digits


def _call(value: Any, arguments_key: str) -> Call:
    """(name, arguments) of a call's JSON object; KeyError / TypeError when it is not one."""
    name = value["name"]
    if not isinstance(name, str):
        raise TypeError("name")
    if arguments_key not in value and "arguments" in value:  # Llama writes either
        arguments_key = "arguments"
    return name, value[arguments_key]


def _read_blocks(text: str) -> list[Call] | None:
    """<tool_call>{...}</tool_call> blocks (whitespace around the JSON allowed)."""
    if not text.lstrip().startswith("<tool_call>"):
        return None
    calls = [_call(json.loads(body), "arguments") for body in _BLOCK.findall(text)]
    return calls or None


def _read_llama(text: str) -> list[Call] | None:
    """JSON objects separated by ";" (after an optional <|python_tag|>), nothing else."""
    text = text.strip()
    text = text.removeprefix(_PYTHON_TAG).lstrip()
    if not text.startswith("{"):
        return None
    decoder, at = json.JSONDecoder(), 0
    calls: list[Call] = []
    while at < len(text):
        value, at = decoder.raw_decode(text, at)
        calls.append(_call(value, "parameters"))
        rest = text[at:].lstrip()
        if rest and not rest.startswith(";"):
            return None
        at = len(text) - len(rest.removeprefix(";").lstrip())
    return calls


def _read_mistral(text: str) -> list[Call] | None:
    """[TOOL_CALLS] then a JSON array of call objects."""
    text = text.strip()
    if not text.startswith("[TOOL_CALLS]"):
        return None
    values = json.loads(text.removeprefix("[TOOL_CALLS]"))
    if not isinstance(values, list):
        return None
    return [_call(value, "arguments") for value in values] or None


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _mistral_call_id() -> str:
    """Mistral's templates refuse a call id that is not 9 letters or digits."""
    return "".join(secrets.choice(_MISTRAL_ID) for _ in range(9))


@dataclass(frozen=True)
class ToolSyntax:
    """One way of writing calls. `calls` / `one_call`: Lark rules for the answer's calls
    (parallel or not) over `call`, itself over `body` (one call's JSON object, whose arguments
    sit under `arguments_key`); `text`: a Lark regex for a free answer under tool_choice auto,
    which must not start as a call does (`opening`)."""

    name: ToolFormat | None  # None: the server's own, for a template without tools
    opening: str
    calls: str
    one_call: str
    call: str
    text: str
    arguments_key: str
    spaced: bool  # JSON spaced ", " / ": " as a template's tojson writes it, else compact
    read: Callable[[str], list[Call] | None]
    new_id: Callable[[], str] = _call_id

    @property
    def by_template(self) -> bool:
        """The chat template renders the tools and the calls sent back (else the server)."""
        return self.name is not None

    def parse(self, text: str) -> list[Call] | None:
        """The calls an answer made, or None when it is text (or calls cut by max_tokens,
        or malformed: the text is the answer then)."""
        try:
            return self.read(text)
        except (ValueError, KeyError, TypeError):
            return None


LONGSERVE = ToolSyntax(
    name=None,
    opening="<tool_call>",
    calls="call+",
    one_call="call",
    call='"<tool_call>" body "</tool_call>"',
    text=r"/[^<][\s\S]*/",
    arguments_key="arguments",
    spaced=False,
    read=_read_blocks,
)
HERMES = ToolSyntax(
    name="hermes",
    opening="<tool_call>",
    calls=r'call ("\n" call)*',
    one_call="call",
    call=r'"<tool_call>\n" body "\n</tool_call>"',
    text=r"/[^<][\s\S]*/",
    arguments_key="arguments",
    spaced=True,
    read=_read_blocks,
)
LLAMA3_JSON = ToolSyntax(
    name="llama3_json",
    opening="{",
    calls='call ("; " call)*',
    one_call="call",
    call="body",
    text=r"/[^{][\s\S]*/",
    arguments_key="parameters",
    spaced=True,
    read=_read_llama,
)
MISTRAL = ToolSyntax(
    name="mistral",
    opening="[TOOL_CALLS]",
    calls='"[TOOL_CALLS]" " "? "[" call (", " call)* "]"',
    one_call='"[TOOL_CALLS]" " "? "[" call "]"',
    call="body",
    text=r"/[^\[][\s\S]*/",
    arguments_key="arguments",
    spaced=True,
    read=_read_mistral,
    new_id=_mistral_call_id,
)
SYNTAXES: dict[ToolFormat | None, ToolSyntax] = {
    s.name: s for s in (LONGSERVE, HERMES, LLAMA3_JSON, MISTRAL)
}


def syntax_of(tool_format: ToolFormat | None) -> ToolSyntax:
    """The syntax of the engine's ModelInfo.tool_format (None: the server's own)."""
    return SYNTAXES[tool_format]


def tool_grammar(
    syntax: ToolSyntax, functions: list[dict[str, Any]], mode: str, parallel: bool
) -> str:
    """A Lark grammar (llguidance's dialect, with %json for a call's object) forcing calls of
    the functions in this syntax; under mode "auto", a free answer is the alternative."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                syntax.arguments_key: bounded_numbers(f["parameters"]),
            },
            "required": ["name", syntax.arguments_key],
            "additionalProperties": False,
        }
        for f in functions
    ]
    body = calls[0] if len(calls) == 1 else {"anyOf": calls}
    options: dict[str, Any] = {"whitespace_flexible": False}
    if syntax.spaced:
        options |= {"item_separator": ", ", "key_separator": ": "}
    body = {"x-guidance": options, **body}
    lines = [
        f"calls: {syntax.calls if parallel else syntax.one_call}",
        f"call: {syntax.call}",
        f"body: %json {json.dumps(body)}",
    ]
    if mode == "auto":
        return "\n".join(["start: TEXT | calls", *lines, f"TEXT: {syntax.text}"]) + "\n"
    return "\n".join(["start: calls", *lines]) + "\n"
