"""The contract: what the server may ask of an engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from engine.protocol.outputs import (
    CollectionAttachment,
    EngineHealth,
    EngineStats,
    GenerationDelta,
    IngestProgress,
    ModelInfo,
    SessionMemoryInfo,
    SessionTurn,
    Tokenized,
    TokenizerInfo,
)
from engine.protocol.requests import MemorySpec, PreparedPrompt, Prompt, SamplingParams, TokenPrompt


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
