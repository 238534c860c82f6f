"""OpenAI's wire format as pydantic models: requests, responses, stream chunks, errors.

Fields follow OpenAI's order; longserve's extensions sit in one marked block at the end of each
request model. Unknown fields are ignored, as OpenAI does. Limits that depend on the server's
settings (max n, max tokens, stop list length) are checked in server/serving/, not here.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def _check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's metadata rules: at most 16 pairs, keys up to 64 chars, values up to 512."""
    if value is None:
        return value
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"at most {MAX_METADATA_PAIRS} metadata pairs are allowed")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters")
        if len(item) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"metadata values are at most {MAX_METADATA_VALUE_CHARS} characters")
    return value


# `metadata` wherever the API takes it (responses, sessions): strings only, bounded as above.
Metadata = Annotated[dict[str, str] | None, AfterValidator(_check_metadata)]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------------------------------
# Shared request pieces.
# ---------------------------------------------------------------------------------------------


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False


MAX_MEMORY_KNOBS = 32
MAX_KNOB_NAME_CHARS = 32
MAX_KNOB_STRING_CHARS = 64


class MemoryRequest(OpenAIModel):
    """longserve extension: the memory strategy and its knobs (k, w, c, m, r, u ...). Knobs are
    short names with scalar values; the engine refuses the ones its strategy does not have."""

    model_config = ConfigDict(extra="allow")

    strategy: str = "segments"
    # No knob names a server file (docs/decisions/056-no-client-paths.md): the old
    # neurocache path is refused by name, pointing at `projection` (an id).
    projection_path: SkipJsonSchema[None] = Field(default=None, exclude=True)

    @field_validator("projection_path", mode="before")
    @classmethod
    def _refuse_paths(cls, value: Any) -> None:
        raise ValueError(
            "memory knobs never name server files; name an operator's projection by id with "
            "memory.projection"
        )

    @model_validator(mode="after")
    def _scalar_knobs(self) -> MemoryRequest:
        knobs = self.model_extra or {}
        if len(knobs) > MAX_MEMORY_KNOBS:
            raise ValueError(f"at most {MAX_MEMORY_KNOBS} memory knobs")
        for name, value in knobs.items():
            if not name.isidentifier() or len(name) > MAX_KNOB_NAME_CHARS:
                raise ValueError(
                    f"memory knob names are identifiers of at most {MAX_KNOB_NAME_CHARS} characters"
                )
            if isinstance(value, str) and len(value) > MAX_KNOB_STRING_CHARS:
                raise ValueError(
                    f"memory knob values are at most {MAX_KNOB_STRING_CHARS} characters"
                )
            if value is not None and not isinstance(value, bool | int | float | str):
                raise ValueError("memory knob values are numbers, booleans or short strings")
        return self

    def knobs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, sent back
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JSONSchemaFormat(OpenAIModel):
    name: str = "response"
    description: str | None = None
    # the wire name is "schema" (pydantic's BaseModel has a `schema` method)
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JSONSchemaFormat | None = None


# ---------------------------------------------------------------------------------------------
# Requests.
# ---------------------------------------------------------------------------------------------


class ChatCompletionRequest(OpenAIModel):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int | None = Field(default=1, ge=1)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    user: str | None = None

    # --- longserve extensions -----------------------------------------------------------------
    session_id: str | None = None
    memory: MemoryRequest | None = None
    top_k: int | None = Field(default=None, ge=-1)
    ignore_eos: bool | None = False


class CompletionRequest(OpenAIModel):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(default=None, ge=1)
    echo: bool | None = False
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(default=16, ge=1)
    n: int | None = Field(default=1, ge=1)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    user: str | None = None
    response_format: ResponseFormat | None = None  # as vLLM accepts it on completions

    # --- longserve extensions -----------------------------------------------------------------
    session_id: str | None = None
    memory: MemoryRequest | None = None
    top_k: int | None = Field(default=None, ge=-1)
    ignore_eos: bool | None = False


class ResponseTextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseText(OpenAIModel):
    format: ResponseTextFormat | None = None


class ResponseCreateRequest(OpenAIModel):
    """POST /v1/responses (OpenAI's Responses API; server/serving/responses.py)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    text: ResponseText | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    metadata: Metadata = None
    user: str | None = None

    # --- longserve extensions -----------------------------------------------------------------
    memory: MemoryRequest | None = None


# ---------------------------------------------------------------------------------------------
# Responses.
# ---------------------------------------------------------------------------------------------


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = (
        0  # of prompt_tokens, read from a reused prefix (engine/caches/prefix_cache.py)
    )


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(OpenAIModel):
    content: list[ChatCompletionTokenLogprob] | None = None


class ChatCompletionMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChoiceDelta(OpenAIModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionChunkChoice(OpenAIModel):
    index: int
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(OpenAIModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "longserve"
    # --- longserve extensions -----------------------------------------------------------------
    max_model_len: int | None = None
    strategies: list[str] = Field(default_factory=list)
    # an answer adapter's card names the model it adapts (vLLM's LoRA cards do the same)
    parent: str | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo
