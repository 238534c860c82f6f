"""The backend whose sessions keep a `SessionMemory` on the device (segments, tokens, neurocache).

The engine reaches every session through the calls of `SessionBackend` (engine/sessions/backend.py),
whatever keeps its memory; `FrameBackend` is one backend, `LarimarBackend`
(engine/sessions/larimar.py) the other. Everything named *_steps runs on the device thread
(engine/scheduler/worker.py); the async methods only validate, queue and wait. The conversations'
table is written on the device thread only.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable, Generator
from typing import TYPE_CHECKING, Literal

import torch

from engine.caches.prefix_cache import PrefixCache, reading_units
from engine.caches.prefix_store import PrefixStore
from engine.caches.store import StoreBridge, document_id
from engine.config import EngineConfig
from engine.memory.mapped import disk_arena
from engine.memory.projections import Projections
from engine.memory.session import SessionMemory
from engine.memory.strategies import STRATEGIES
from engine.protocol import (
    CollectionAttachment,
    GenerationDelta,
    IngestProgress,
    InvalidRequest,
    MemorySpec,
    Prompt,
    SamplingParams,
    SessionMemoryInfo,
    SessionNotFound,
    SessionTurn,
)
from engine.runner.adapter import AnswerAdapter
from engine.runner.copy_numbers import digit_tokens
from engine.runner.generate import Generation
from engine.scheduler.stream import aborted_delta, on_device, submit
from engine.scheduler.worker import Worker
from engine.sessions.backend import Decoding
from engine.sessions.conversation import Conversation, check_memory_cap, turn_prompt
from engine.sessions.document_collections import DocumentCollections
from engine.sessions.frame_text import FrameTextState, answering
from engine.sessions.ingest import read_document_steps
from engine.sessions.memory_state import MemoryState
from engine.sessions.prior_query import prior_encoder, prior_query
from engine.sessions.tiers import offload_idle, spill_past_budget

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class FrameBackend:
    """The session backend whose memory is a SessionMemory on the device."""

    strategies: tuple[str, ...] = STRATEGIES

    def __init__(
        self,
        model: PreTrainedModel,
        config: EngineConfig,
        worker: Worker,
        decoding: Decoding,
        encode: Callable[[Prompt], torch.Tensor],
        store: StoreBridge | None,
        model_fingerprint: str,
        kv_dtype: str = "model",
    ) -> None:
        self.model = model
        self.config = config
        self.kv_dtype = kv_dtype  # resolved (LoadedModel.kv_dtype): memories' sinks and window
        self.decoding = decoding
        self._worker = worker
        self._encode = encode  # asyncio side: prompt -> ids (T,), InvalidRequest when empty
        self._store = store
        self._model_fingerprint = model_fingerprint
        self.encoder = prior_encoder(config)  # the memories' text prior (None: off)
        self.projections = Projections(config.projection_dir, config.max_projection_bytes)
        self.arena = disk_arena(config)  # memory blocks' disk tier (mapped.py); None: off
        self.conversations: dict[str, Conversation] = {}  # written on the device thread only
        self._ingest_ids: set[str] = set()  # running ingestions (drop fails them)
        self.collections = DocumentCollections(
            self.conversations, config, decoding, worker, store, model_fingerprint, self._answering
        )
        self.prefixes = PrefixCache(config.prefix_cache_bytes)  # long prompts' reused memories
        self.prefix_store = (  # ... and the same through the memory store, for every replica
            PrefixStore(store, model_fingerprint, config.prefix_store_max_entries_per_tenant)
            if store is not None and config.prefix_cache_store
            else None
        )

    def __contains__(self, session_id: object) -> bool:
        return session_id in self.conversations

    def _check_strategy(self, spec: MemorySpec) -> None:
        if spec.strategy not in STRATEGIES:
            raise InvalidRequest(
                f"unknown memory strategy {spec.strategy!r}; expected one of {STRATEGIES}",
                param="memory",
            )
        if (spec.params or {}).get("copy_numbers") and self._digits is None:
            raise InvalidRequest(
                "memory.copy_numbers needs a tokenizer that gives each digit a token of its own; "
                "this model's does not",
                param="memory.copy_numbers",
            )

    @functools.cached_property
    def _digits(self) -> tuple[int, ...] | None:
        """The tokenizer's digit tokens, or None where digits share tokens (copy_numbers)."""
        return digit_tokens(self.decoding.tokenizer)

    # -- the session backend (asyncio side) ------------------------------------------------------

    async def create(self, session_id: str, spec: MemorySpec) -> None:
        self._check_strategy(spec)

        def create() -> None:
            if session_id in self.conversations:
                raise InvalidRequest(f"session {session_id!r} already exists", param="session_id")
            self.conversations[session_id] = Conversation(self.new_memory(spec), spec.strategy)

        await on_device(self._worker, create)

    async def drop(self, session_id: str) -> None:
        def drop() -> None:
            for request_id in self._worker.jobs_for_session(session_id):
                job_error = SessionNotFound(f"session {session_id!r} was dropped")
                is_ingest = request_id in self._ingest_ids
                self._worker.abort(request_id, job_error if is_ingest else None)
            self.conversations.pop(session_id, None)

        await on_device(self._worker, drop)

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
        if prompt_ids is None:
            prompt_ids = self._encode(prompt)  # (T,)
        total = len(prompt_ids) + sampling.max_tokens
        queued_at = time.perf_counter()
        if session_id not in self.conversations:
            raise SessionNotFound(f"session {session_id!r} has no memory")
        session = self.conversations[session_id]
        check_memory_cap(session.memory.num_tokens + total, self.config.max_memory_tokens)
        if session.selected:
            return self.collections.selected_generate(
                request_id,
                prompt,
                prompt_ids,
                sampling,
                session_id,
                queued_at,
                memory_room,
                adapter=adapter,
            )
        steps = self._session_steps(
            session_id, prompt, prompt_ids, sampling, queued_at, memory_room, adapter
        )
        return submit(self._worker, request_id, steps, session_id, aborted_delta(len(prompt_ids)))

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
        self._check_strategy(spec)
        steps = self._ephemeral_steps(spec, prompt, prompt_ids, sampling, queued_at, scope, adapter)
        on_abort = aborted_delta(len(prompt_ids))
        return submit(self._worker, request_id, steps, None, on_abort, tenant=scope)

    def ingest(self, request_id: str, session_id: str, text: str) -> AsyncIterator[IngestProgress]:
        if session_id not in self.conversations:
            raise SessionNotFound(f"session {session_id!r} has no memory")
        if not isinstance(text, str):
            raise InvalidRequest("text must be a string", param="text")
        steps = self._ingest_steps(request_id, session_id, text)
        return submit(self._worker, request_id, steps, session_id, None)

    async def attach_collection(self, session_id: str, name: str) -> CollectionAttachment:
        return await self.collections.attach(session_id, name)

    async def import_turn(self, session_id: str, turn: SessionTurn) -> None:
        def take() -> None:
            session = self.conversations.get(session_id)
            if session is None:
                raise SessionNotFound(f"session {session_id!r} has no memory")
            session.import_turn(turn)

        await on_device(self._worker, take)

    def memory_info(self, session_id: str) -> SessionMemoryInfo | None:
        session = self.conversations.get(session_id)
        if session is None:
            return None
        memory = session.memory
        tier: Literal["device", "host", "disk"] = "device"
        if memory.on_disk:
            tier = "disk"
        elif memory.offloaded or memory.config.tier == "host":
            tier = "host"
        return SessionMemoryInfo(tokens=int(memory.num_tokens), tier=tier)

    # -- the device thread ----------------------------------------------------------------------

    def _answering(self, state: MemoryState) -> MemoryState | FrameTextState:
        digits = self._digits if state.memory.config.copy_numbers else None
        return answering(state, self.model, self.kv_dtype, digits)  # frame_text.py

    def new_memory(self, spec: MemorySpec) -> SessionMemory:
        """A memory of this engine's model, with the text prior when the engine has one."""
        memory = SessionMemory(
            self.model,
            spec,
            self.kv_dtype,
            self.projections,
            self.arena,
            self.config.session_ram_bytes if self.arena is not None else 0,
        )
        if self.encoder is not None:
            tokenizer = self.decoding.tokenizer
            memory.attach_prior(self.encoder, lambda ids: str(tokenizer.decode(list(ids))))
        return memory

    def _ephemeral_steps(
        self,
        spec: MemorySpec,
        prompt: Prompt,
        prompt_ids: torch.Tensor,
        sampling: SamplingParams,
        queued_at: float,
        scope: str | None,
        adapter: AnswerAdapter | None = None,
    ) -> Generator[GenerationDelta | None, None, None]:
        """A long prompt: its body (before the question's tail) is a document, read in whole
        chunks, from a memory kept for an earlier prompt of `scope` that started with the same
        chunks when there is one (engine/caches/prefix_cache.py), then from the memory store's chunks
        of the same chain (engine/caches/prefix_store.py)."""
        memory = self.new_memory(spec)
        body = memory.config.tail_start(len(prompt_ids))  # the document, before the question
        document_end = body if 0 < body < len(prompt_ids) else None
        step, unit = reading_units(memory.config.chunk_size, self.decoding.prefill_chunk_tokens)
        reused, keep, write = 0, None, None
        if document_end is not None:
            memory, reused = self.prefixes.start(scope, memory, prompt_ids, document_end, unit)
            if self.prefix_store is not None:
                reused, write = yield from self.prefix_store.start(
                    scope, memory, prompt_ids, reused, document_end, unit
                )
            point = self.prefixes.keep_point(memory, document_end, unit)
            if point is not None and point > reused:
                keep = (point, lambda read: self.prefixes.put(scope, read))
        memory.set_query(prior_query(prompt))
        state = self._answering(
            MemoryState(memory, spec.strategy, document_end, read=reused, keep=keep, write=write)
        )
        yield from Generation(
            state,
            prompt_ids,
            sampling,
            self.decoding.tokenizer,
            queued_at=queued_at,
            prefilled=reused,
            prefill_cuts=() if document_end is None else (document_end,),
            adapter=adapter,
            **{**self.decoding.kwargs(), "prefill_chunk_tokens": step},
        )

    def _session_steps(
        self,
        session_id: str,
        prompt: Prompt,
        prompt_ids: torch.Tensor,
        sampling: SamplingParams,
        queued_at: float,
        memory_room: int | None = None,
        adapter: AnswerAdapter | None = None,
    ) -> Generator[GenerationDelta | None, None, None]:
        """One request on a session's memory. Runs when the session's previous request has
        finished (the worker runs a session's jobs one at a time), so it sees its last turn.

        Chat messages are the whole conversation, as in OpenAI's API: when they start with
        exactly the turns the memory already holds (role and content compared message by
        message; a client resending the whole conversation), only the messages after those
        are appended; otherwise (a new chat, or an edited history) the memory first goes back
        to the end of its documents and all of them are read (Conversation.plan_chat). The
        answer is closed with the template's end of turn. A completion prompt is appended as
        it is, after whatever the memory holds.

        The last delta goes out once the turn is closed, carrying it (`SessionTurn`) for the
        memory store. An aborted or failed request is forgotten when none of it has reached
        memory yet; else it stays, and goes out with the next finished request's turn.
        """
        session = self.conversations.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} has no memory")
        prompt_ids, new, restart = turn_prompt(session, prompt, prompt_ids, self.decoding.tokenizer)
        after = self.decoding.turn_end if new is not None else []
        held = session.restart_tokens if restart else session.memory.num_tokens
        grows = len(prompt_ids) + sampling.max_tokens + len(after)
        check_memory_cap(held + grows, self.config.max_memory_tokens)
        session.check_room(grows, restart, memory_room)
        if restart:
            session.restart()
        mark, hash_before = session.begin_turn()
        session.memory.set_query(prior_query(prompt, session.turns))
        state = self._answering(MemoryState(session.memory, session.strategy))
        generation = Generation(
            state,
            prompt_ids,
            sampling,
            self.decoding.tokenizer,
            queued_at=queued_at,
            after=after,
            hold_final=True,
            adapter=adapter,
            **self.decoding.kwargs(),
        )
        final: GenerationDelta | None = None
        turn: SessionTurn | None = None
        try:
            final = yield from generation  # delegated: its decode steps join the worker's batches
        finally:  # finished, failed or aborted: the memory keeps a whole turn or none
            if self.conversations.get(session_id) is session:
                if isinstance(state, FrameTextState):
                    state.flush()  # the answer read afresh joins the memory
                turn = session.end_request(
                    mark,
                    hash_before,
                    new,
                    restart,
                    generation.unread_tail(),
                    generation.text,
                    finished=final is not None,
                    max_bytes=self.config.max_turn_encoding_bytes,
                )
                session.memory.end_request()
        if final is not None and turn is not None:
            yield dataclasses.replace(final, turns=session.take_unsent(turn))
        elif final is not None:
            yield final

    def _ingest_steps(
        self, request_id: str, session_id: str, text: str
    ) -> Generator[IngestProgress | None, None, None]:
        self._ingest_ids.add(request_id)
        session = self.conversations.get(session_id)
        try:
            if session is None:
                raise SessionNotFound(f"session {session_id!r} has no memory")
            yield from read_document_steps(
                session,
                text,
                self.decoding.tokenizer,
                self.config,
                self._store,
                self._model_fingerprint,
                session_id=session_id,
                doc_id=document_id(request_id),
            )
        finally:
            self._ingest_ids.discard(request_id)
            if session is not None:
                session.last_used = time.monotonic()

    def offload_idle(self) -> None:
        """Worker housekeeping (device thread): idle sessions to host memory, and past the
        RAM budget to the disk tier (tiers.py)."""
        busy = self._worker.busy_sessions()
        offload_idle(self.conversations, busy, self.config.session_offload_after_s)
        if self.arena is not None:
            spill_past_budget(self.conversations, busy, self.config.memory_ram_bytes)
