"""What the engine asks of a session backend, and what every generation runs with.

A backend keeps sessions' memories: `FrameBackend` (engine/sessions/frame_backend.py) a
`SessionMemory` on the device for the strategies segments, tokens and neurocache;
`LarimarBackend` (engine/sessions/larimar.py) the memory store's Larimar memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.protocol import (
    CollectionAttachment,
    GenerationDelta,
    IngestProgress,
    MemorySpec,
    Prompt,
    SamplingParams,
    SessionTurn,
)
from engine.runner.adapter import AnswerAdapter
from engine.runner.grammar import Grammars

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class SessionBackend(Protocol):
    """What the engine asks of a kind of session, whatever keeps its memory."""

    strategies: tuple[str, ...]

    def __contains__(self, session_id: object) -> bool: ...

    async def create(self, session_id: str, spec: MemorySpec) -> None: ...

    async def drop(self, session_id: str) -> None: ...

    def generate(
        self,
        request_id: str,
        session_id: str,
        prompt: Prompt,
        sampling: SamplingParams,
        memory_room: int | None = None,
        *,
        prompt_ids: torch.Tensor | None = None,
        adapter: AnswerAdapter | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        """prompt_ids: the prompt's ids (T,) as the engine prepared them; None: encoded here.
        adapter: what answers (engine/runner/adapter.py); InvalidRequest where it cannot."""
        ...

    def generate_ephemeral(
        self,
        request_id: str,
        prompt: Prompt,
        prompt_ids: torch.Tensor,
        sampling: SamplingParams,
        spec: MemorySpec,
        queued_at: float,
        scope: str | None = None,
        adapter: AnswerAdapter | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        """A prompt too long for the window, read into a memory that ends with the request;
        it may start from a memory kept for an earlier prompt of the same scope (tenant)."""
        ...

    def ingest(
        self, request_id: str, session_id: str, text: str
    ) -> AsyncIterator[IngestProgress]: ...

    async def attach_collection(self, session_id: str, name: str) -> CollectionAttachment: ...

    async def import_turn(self, session_id: str, turn: SessionTurn) -> None: ...


@dataclass(frozen=True)
class Decoding:
    """What every generation on the device thread runs with."""

    tokenizer: PreTrainedTokenizerBase  # the device thread's own copy
    stop_token_ids: frozenset[int]
    prefill_chunk_tokens: int
    vocab_size: int
    turn_end: list[int]  # closes an answer in a session (chat_template.assistant_turn_end)
    grammars: Grammars | None = None  # structured outputs (response_format)

    def kwargs(self) -> dict[str, Any]:
        return {
            "stop_token_ids": self.stop_token_ids,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "vocab_size": self.vocab_size,
            "grammars": self.grammars,
        }
