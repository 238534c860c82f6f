"""What the engine hands back: deltas and their logprobs and stats, a session's turns, memory
and ingest progress, collections, health and stats, and the model and tokenizer it serves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]

ToolFormat = Literal["hermes", "llama3_json", "mistral"]
"""The tool-call syntax a chat template speaks (named as vLLM's parsers): "hermes"
(Qwen2.5, Hermes 2/3: <tool_call>{"name", "arguments"}</tool_call>), "llama3_json" (Llama
3.1-3.3: {"name", "parameters"}), "mistral" ([TOOL_CALLS][{"name", "arguments"}])."""


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
