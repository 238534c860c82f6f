"""The whole boundary between the HTTP server and the engine.

Pure Python (no torch): server/ imports this module and nothing else from engine/. An engine is
anything that implements `EngineClient`; the real one lives in engine/client.py, the tests have a
fake one. Everything crossing the boundary is a plain dataclass.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from memory_store import errors as store_errors

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


FinishReason = Literal["stop", "length", "abort", "error"]

ToolFormat = Literal["hermes", "llama3_json", "mistral"]
"""The tool-call syntax a chat template speaks (named as vLLM's parsers): "hermes"
(Qwen2.5, Hermes 2/3: <tool_call>{"name", "arguments"}</tool_call>), "llama3_json" (Llama
3.1-3.3: {"name", "parameters"}), "mistral" ([TOOL_CALLS][{"name", "arguments"}])."""


# ---------------------------------------------------------------------------------------------
# Errors. The server maps each to one OpenAI-shaped HTTP error.
# ---------------------------------------------------------------------------------------------


class EngineError(Exception):
    """Base of every error the engine raises across the boundary."""


class InvalidRequest(EngineError):
    """Bad input the server could not see (unknown strategy knob, bad stop list...). -> 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLong(InvalidRequest):
    """The prompt exceeds what the engine accepts (window, or the memory hard cap). -> 400."""


class TooManyTokens(PromptTooLong):
    """A prompt past the caller's token limit, its encoding stopped there: `at_least` tokens
    counted so far (the caller names the parameter)."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"The prompt has more than {limit} tokens ({at_least} counted).")
        self.at_least = at_least
        self.limit = limit


class EngineOverloaded(EngineError):
    """The waiting queue is full. -> 429 with Retry-After."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class MemoryBudgetExceeded(EngineError):
    """A request on a session would take its tenant past the memory budget. -> 429."""

    def __init__(self, message: str, needed: int, room: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.room = room


class SessionNotFound(EngineError):
    """The engine holds no memory for this session id. -> 404."""


class CollectionNotFound(EngineError):
    """No collection of that name in the memory store. -> 404."""


class CollectionIncompatible(EngineError):
    """The collection cannot join this session: encoded with another model or memory
    configuration (its fingerprint differs), or the session's strategy keeps no encodings. -> 409."""


class EngineDead(EngineError):
    """A fatal error stopped the worker; /ready fails until the process restarts. -> 503."""


class StoreUnavailableError(EngineError, store_errors.StoreUnavailableError):
    """The memory service could not be reached or failed while a document was ingested. The
    session still holds the document in memory, but its encodings are not (all) durable. -> 503."""


# ---------------------------------------------------------------------------------------------
# Requests.
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Outputs.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlternativeLogprob:
    token: str
    logprob: float
    bytes: list[int] | None


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[AlternativeLogprob]


@dataclass(frozen=True)
class RequestStats:
    """Numbers the engine reports on a request's last delta; server/metrics.py records them."""

    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    retrieval_seconds: float = 0.0
    strategy: str | None = None
    memory_tokens: int = 0
    ingest_tokens: int = 0
    ingest_seconds: float = 0.0


@dataclass(frozen=True)
class GenerationDelta:
    """What one decode step (or a few) added to a choice.

    text holds only whole UTF-8 characters, never any part of a stop string. completion_tokens
    is cumulative. finish_reason and stats are set on the last delta only.
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None
    cached_tokens: int = 0  # of prompt_tokens, those not read again (a reused prefix)
    # last delta of a request on a session: the turns it carries out to the memory store
    turns: tuple[SessionTurn, ...] = ()


@dataclass(frozen=True)
class SessionTurn:
    """What one finished request added to a session's memory, for the memory store: another
    replica rebuilds the session by importing it after the session's documents (no model
    forward when `encoding` is there; its tokens are read again when it is not).

    seq counts the session's turns from 1. restart: the memory first went back to the end of
    its documents, forgetting the conversation held (Conversation.plan_chat). messages: the
    chat messages appended, (role, text) each; None for a completion prompt. commits: tokens
    per commit, in the order the memory committed them. turns / turn_tokens: how many turns,
    and their tokens, the memory holds after this one (documents and collections apart).
    """

    seq: int
    restart: bool
    messages: list[tuple[str, str]] | None
    answer: str
    token_ids: list[int]
    commits: list[int]
    hash_before: str | None
    hash_after: str | None
    turns: int
    turn_tokens: int
    encoding: bytes | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class IngestProgress:
    """Progress of one document being read into a session's memory."""

    tokens_done: int
    tokens_total: int
    seconds: float
    done: bool = False
    tokens_from_store: int = 0
    """Of tokens_done, how many were rebuilt from the memory store's encodings instead of being
    run through the model (ingest_tokens_total counts only the others)."""


@dataclass(frozen=True)
class CollectionAttachment:
    """A collection attached to a session.

    loading "whole": its chunks were read into the session's memory when it was attached.
    "selected": too many chunks for that (`collection_max_chunks`); each request on the session
    loads only the top-k chunks by EmbQ(query) . EmbD(chunk).
    """

    name: str
    chunks: int
    tokens: int
    loading: Literal["whole", "selected"]


@dataclass(frozen=True)
class EngineHealth:
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class EngineStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    sessions_active: int = 0
    memory_tokens: int = 0
    sessions_offloaded: int = 0  # of sessions_active, those moved to host memory while idle
    sessions_on_disk: int = 0  # ... those whose memory blocks are in the disk tier
    memory_disk_bytes: int = 0  # what the disk tier's files span now (engine/memory/mapped.py)
    # long prompts' prefix reuse (engine/caches/prefix_cache.py): counters since start, and what the
    # cache holds now
    prefix_cache_hits: int = 0
    prefix_cache_misses: int = 0
    prefix_cache_tokens_reused: int = 0
    prefix_cache_evictions: int = 0
    prefix_cache_entries: int = 0
    prefix_cache_bytes: int = 0
    # ... through the memory store (engine/caches/prefix_store.py), counters since start
    prefix_cache_store_hits: int = 0
    prefix_cache_store_tokens_imported: int = 0
    prefix_cache_store_chunks_written: int = 0
    prefix_cache_store_failures: int = 0
    # structured outputs (engine/runner/grammar.py): grammars compiled and reused since start
    grammars_compiled: int = 0
    grammar_cache_hits: int = 0
    grammar_compile_seconds: float = 0.0


@dataclass(frozen=True)
class SessionMemoryInfo:
    """Where a session's memory is now. tier "host": in host memory (an idle session moved
    off the device, or one whose memory is configured to live there), "device": beside the
    model (on a CPU-only engine both are the same memory); "disk": its memory blocks are in
    the disk tier (engine/memory/mapped.py)."""

    tokens: int
    tier: Literal["device", "host", "disk"]


@dataclass(frozen=True)
class ModelInfo:
    """The served model. tool_format: the tool-call syntax its chat template renders tools
    in, read once from the template at load; None when the template renders no tools (the
    server then renders them itself, docs/decisions/066-tool-call-formats.md)."""

    id: str
    max_model_len: int
    strategies: tuple[str, ...] = ()
    created: int = 0
    tool_format: ToolFormat | None = None
    adapters: tuple[str, ...] = ()  # answer adapters' model ids: "<id>:<name>"


@dataclass(frozen=True)
class Tokenized:
    """A prompt's token ids as the model reads it (chat messages through the template), and
    each id's token string when asked for (the tokenizer's own spelling, e.g. "Ġhello")."""

    ids: list[int]
    strings: list[str] | None = None


@dataclass(frozen=True)
class TokenizerInfo:
    """What a client needs to count and cut prompts as the server does (vLLM's
    /tokenizer_info): the special tokens, the chat template, the vocabulary's size."""

    tokenizer_class: str
    vocab_size: int
    model_max_length: int
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None


# ---------------------------------------------------------------------------------------------
# The contract.
# ---------------------------------------------------------------------------------------------


@runtime_checkable
class EngineClient(Protocol):
    """What the server may ask of an engine. Every call is safe from the asyncio loop."""

    @property
    def model(self) -> ModelInfo: ...

    async def prepare(
        self,
        prompt: Prompt | TokenPrompt,
        sampling: SamplingParams,
        *,
        tenant: str | None = None,
        token_limit: int | None = None,
    ) -> PreparedPrompt:
        """Tokenize the prompt and compile its grammar, off the asyncio loop, once for all of
        a request's choices. InvalidRequest for an empty prompt or a grammar that cannot be
        enforced; PromptTooLong as soon as more than token_limit tokens are counted (a huge
        prompt is not tokenized whole to be refused); EngineOverloaded when the tenant has too
        many prompts being prepared. A TokenPrompt is read as its ids (InvalidRequest naming
        one outside the vocabulary); the prepared prompt then holds their text.
        Cancelling it before its turn comes leaves nothing running."""
        ...

    def generate(
        self,
        request_id: str,
        prompt: Prompt | PreparedPrompt,
        sampling: SamplingParams,
        *,
        session_id: str | None = None,
        memory: MemorySpec | None = None,
        tenant: str | None = None,
        memory_room: int | None = None,
        adapter: str | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        """Queue a generation and stream its deltas; `prompt` as `prepare` made it (a bare
        Prompt is tokenized on the caller's thread). tenant: whose request it is; long prompts
        reuse cached prefixes of their own tenant's earlier prompts only. memory_room: on a
        session, how many tokens its memory may still grow by (the tenant's budget left);
        MemoryBudgetExceeded, changing nothing, when the request could take more. Raises EngineOverloaded when the waiting
        queue is full (before anything is yielded), PromptTooLong / InvalidRequest on bad input.
        adapter: a model id of ModelInfo.adapters: its adapter answers (the base model reads
        the prompt but its last tokens); None or the model's id: the base model.
        Closing the iterator early aborts the request in the worker."""
        ...

    async def count_tokens(self, prompt: Prompt) -> int:
        """Tokens the prompt takes after chat templating (for limits and usage)."""
        ...

    async def tokenize(
        self,
        prompt: Prompt,
        *,
        add_special_tokens: bool = True,
        generation_prompt: bool = True,
        token_strings: bool = False,
        tenant: str | None = None,
        token_limit: int | None = None,
    ) -> Tokenized:
        """The prompt's ids as generate would read them, off the asyncio loop within the
        tenant's share of the preprocessing threads (PromptTooLong past token_limit). add_special_tokens: for a text prompt,
        the tokenizer's BOS/EOS (a chat template writes its own); generation_prompt: for chat
        messages, the assistant's opening appended."""
        ...

    async def detokenize(self, token_ids: Sequence[int], *, tenant: str | None = None) -> str:
        """The text of token ids; InvalidRequest naming the first id outside the vocabulary."""
        ...

    @property
    def tokenizer_info(self) -> TokenizerInfo: ...

    async def abort(self, request_id: str) -> None:
        """Stop a request now; its iterator ends with finish_reason "abort". Idempotent."""
        ...

    async def create_session(self, session_id: str, memory: MemorySpec | None = None) -> None:
        """Give a session an empty memory. InvalidRequest for a bad MemorySpec."""
        ...

    async def drop_session(self, session_id: str) -> None:
        """Free a session's memory at once (cancelling its ingestion). Idempotent."""
        ...

    async def import_turn(self, session_id: str, turn: SessionTurn) -> None:
        """Rebuild a turn another replica's session took (a restore, after the documents read
        before it). InvalidRequest when the session does not stand where the turn began."""
        ...

    def ingest(self, request_id: str, session_id: str, text: str) -> AsyncIterator[IngestProgress]:
        """Read a document into a session's memory segment by segment, streaming progress.
        SessionNotFound if the session has no memory. Closing the iterator cancels it."""
        ...

    def session_memory_info(self, session_id: str) -> SessionMemoryInfo | None:
        """The session's memory now; None when this engine holds none in its own memory
        (unknown session, or one kept in the memory service)."""

    async def attach_collection(self, session_id: str, name: str) -> CollectionAttachment:
        """Attach a pre-encoded collection (`longserve ingest`) to a session, with no model
        forward. Idempotent. CollectionNotFound, CollectionIncompatible, SessionNotFound,
        StoreUnavailableError; any of them leaves the session unchanged."""
        ...

    async def health(self) -> EngineHealth: ...

    def stats(self) -> EngineStats: ...

    async def shutdown(self) -> None: ...
