"""What the server hands the engine: prompts, sampling, structured outputs, memory specs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

PromptMessage = Mapping[str, Any]
"""One chat message as OpenAI sends it: {"role": ..., "content": str | list of text parts}. For
a chat template that renders tools (`ModelInfo.tool_format`), an assistant message may carry
`tool_calls` ([{"id", "type": "function", "function": {"name", "arguments": an object}}]), a
tool message its `tool_call_id`, and the first message the request's `tools` (OpenAI function
tools): the template renders them in the model's own syntax."""

Prompt = str | Sequence[PromptMessage]
"""A completion prompt (str, used verbatim) or chat messages (rendered by the chat template)."""


@dataclass(frozen=True)
class TokenPrompt:
    """A completion prompt given as token ids (OpenAI's `prompt: [int, ...]`), read as they
    are; `EngineClient.prepare` checks them against the vocabulary."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class StructuredOutput:
    """A structured output the tokens must follow (engine/runner/grammar.py): any JSON object
    ("json_object"), JSON valid against `schema` ("json_schema"; the schema as JSON text), or
    text of a grammar in llguidance's Lark dialect ("lark"; `schema` holds the grammar)."""

    type: Literal["json_object", "json_schema", "lark"]
    schema: str | None = None
    param: str = "response_format"  # the request field it came from, named when refused


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI's sampling semantics, plus top_k. One choice: the server fans out n > 1 itself.

    temperature == 0 means greedy. top_k == 0 means no top-k cut. seed makes the choice
    reproducible on the same engine. stop strings are never part of the returned text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: StructuredOutput | None = None


@dataclass(frozen=True)
class MemorySpec:
    """Which memory strategy a session or request uses, and its knobs (named as in the papers:
    k, w, c, m, r, u ...). The engine validates the knobs and raises InvalidRequest."""

    strategy: str = "segments"
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt tokenized (chat template applied) and its grammar compiled by
    `EngineClient.prepare`, once per request and off the asyncio loop; `generate` takes it in
    place of the prompt, for each choice. `token_ids` is the engine's own: the server reads
    `num_tokens` only."""

    prompt: Prompt
    num_tokens: int
    token_ids: Any = field(default=None, repr=False, compare=False)
