"""Collections (Decoupled Context Processing): document encodings stored once by `longserve
ingest`, attached to a memory session with no model forward, or, for a collection too large to
load whole, searched per request by EmbQ(x) . EmbD(c) and read into that request's fork.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable, Generator, Sequence

import torch

from engine.caches.store import StoreBridge, session_fingerprint
from engine.config import EngineConfig
from engine.protocol import (
    CollectionAttachment,
    CollectionIncompatible,
    CollectionNotFound,
    GenerationDelta,
    InvalidRequest,
    Prompt,
    SamplingParams,
    SessionNotFound,
    StoreUnavailableError,
)
from engine.runner.adapter import AnswerAdapter
from engine.runner.decode_state import DecodeState
from engine.runner.generate import Generation
from engine.scheduler.stream import aborted_delta, on_device, submit
from engine.scheduler.worker import Worker
from engine.sessions.backend import Decoding
from engine.sessions.conversation import Collection, Conversation, check_memory_cap, turn_prompt
from engine.sessions.memory_state import MemoryState
from engine.sessions.prior_query import prior_query
from memory_store.client import ChunkEncoding, ChunkRef, TextEncoder, default_embedder
from memory_store.errors import InvalidStoreRequest, NotFound


class DocumentCollections:
    """The collections of memory sessions: attach, select, and generate on a fork."""

    def __init__(
        self,
        conversations: dict[str, Conversation],
        config: EngineConfig,
        decoding: Decoding,
        worker: Worker,
        store: StoreBridge | None,
        model_fingerprint: str,
        answering: Callable[[MemoryState], DecodeState] = lambda state: state,
    ) -> None:
        self._conversations = conversations  # the backend's table (device thread writes it)
        self._config = config
        self._decoding = decoding
        self._worker = worker
        self._store = store
        self._model_fingerprint = model_fingerprint
        self._answering = answering  # the state an answer runs on (answer_read; frame_text.py)
        # EmbQ for collections too large to load whole; None: the bundled MiniLM (EmbD's).
        self.query_encoder: TextEncoder | None = None

    def _bridge(self) -> StoreBridge:
        if self._store is None:
            raise InvalidRequest(
                "collections need a memory store (--data-dir or --memory-store)",
                param="collections",
            )
        return self._store

    async def _fetch_chunks(self, refs: Sequence[ChunkRef]) -> list[ChunkEncoding]:
        bridge = self._bridge()
        out = []
        for ref in refs:
            try:
                get = functools.partial(bridge.client.get_chunk, ref.fingerprint, ref.chain_hash)
                out.append(await bridge.acall("get_chunk", get))
            except NotFound as e:
                raise StoreUnavailableError(
                    f"chunk {ref.chain_hash} of a collection is missing from the memory store"
                ) from e
        return out

    async def attach(self, session_id: str, name: str) -> CollectionAttachment:
        """Attach `name` (written by `longserve ingest`) to the session.

        Its chunks must carry this session's fingerprint (model + strategy + memory knobs):
        encodings made under another configuration mean something else to this frame. A
        collection of at most `collection_max_chunks` chunks is read whole now, in document
        order, by `import_chunk` (no forward): everything is fetched before anything is
        imported, so a store failure changes nothing. A larger one is only recorded here; each
        request then loads its EmbQ selection (`selected_generate`).
        """
        session = self._conversations.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} has no memory")
        if name in session.collections:
            return session.collections[name].attachment
        bridge = self._bridge()
        try:
            refs = await bridge.acall(
                "collection_chunks", lambda: bridge.client.collection_chunks(name)
            )
        except InvalidStoreRequest as e:
            raise InvalidRequest(str(e), param="name") from e
        except NotFound as e:
            raise CollectionNotFound(f"collection {name!r} not found") from e
        wanted = session_fingerprint(self._model_fingerprint, session.memory)
        if any(ref.fingerprint != wanted for ref in refs):
            raise CollectionIncompatible(
                f"collection {name!r} was encoded with another model or memory configuration "
                f"than this session's {session.strategy!r} memory; re-run `longserve ingest` "
                "with the session's strategy and knobs, or create the session with theirs"
            )
        order = {ref.chain_hash: i for i, ref in enumerate(refs)}
        if len(refs) > self._config.collection_max_chunks:
            attached = CollectionAttachment(name, len(refs), 0, "selected")

            def record() -> None:
                session.collections[name] = Collection(attached, order)

            await on_device(self._worker, record)
            return attached
        chunks = await self._fetch_chunks(refs)
        tokens = sum(chunk.num_tokens for chunk in chunks)
        check_memory_cap(session.memory.num_tokens + tokens, self._config.max_memory_tokens)
        attached = CollectionAttachment(name, len(refs), tokens, "whole")

        def load() -> None:
            if self._conversations.get(session_id) is not session:
                raise SessionNotFound(f"session {session_id!r} was dropped")
            if name in session.collections:
                return
            session.memory.reserve(tokens)
            for chunk in chunks:
                session.memory.import_chunk(chunk)
            session.collections[name] = Collection(attached, order)
            session.read_document(None)

        await on_device(self._worker, load)
        return attached

    async def _select(self, session: Conversation, prompt: Prompt) -> list[ChunkEncoding]:
        """EmbQ(x) . EmbD(c) top-k of each selected collection, in document order."""
        bridge = self._bridge()
        encoder = self.query_encoder or default_embedder()
        # the text prior's EmbQ input: the question, then the answer before it
        query = await asyncio.to_thread(encoder.embed, [prior_query(prompt)])  # (1, d)
        picked: list[tuple[int, int, ChunkRef]] = []
        for rank, collection in enumerate(session.selected):
            name = collection.attachment.name
            try:
                select = functools.partial(
                    bridge.client.select_chunks,
                    name,
                    query[0],
                    self._config.collection_top_k,
                )
                refs = await bridge.acall("select_chunks", select)
            except InvalidStoreRequest as e:  # EmbQ and EmbD from different encoders
                raise CollectionIncompatible(f"collection {name!r}: {e}") from e
            except NotFound as e:
                raise CollectionNotFound(f"collection {name!r} is no longer stored") from e
            picked += [(rank, collection.order.get(r.chain_hash, 0), r) for r in refs]
        picked.sort(key=lambda p: (p[0], p[1]))
        return await self._fetch_chunks([ref for _, _, ref in picked])

    async def selected_generate(
        self,
        request_id: str,
        prompt: Prompt,
        prompt_ids: torch.Tensor,
        sampling: SamplingParams,
        session_id: str,
        queued_at: float,
        memory_room: int | None = None,
        adapter: AnswerAdapter | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        """A request on a session with a large collection: select, then generate on a fork.

        The selected chunks are read into a fork of the session's memory made for this request
        (after the session's own documents and turns, just before the question), never into
        the session's memory itself: the next question selects its own chunks, and a memory
        that kept every selection would grow into the whole collection and fill its frame with
        chunks picked for earlier questions. Re-forking per request (rather than caching a fork
        per selection) costs no forward and no copy of the session's keys and values (a fork
        shares them until it writes over rows the session holds: engine/memory/buffers.py); a
        cache could not be reused anyway, since every turn changes the session. The turn (question
        and answer) then joins the session's own memory, one forward over its tokens, so later
        questions can refer to it as in any session.
        """
        session = self._conversations.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} has no memory")
        chunks = await self._select(session, prompt)
        selected_tokens = sum(c.num_tokens for c in chunks)
        check_memory_cap(
            session.memory.num_tokens + selected_tokens + len(prompt_ids) + sampling.max_tokens,
            self._config.max_memory_tokens,
        )
        steps = self._fork_steps(
            session_id, chunks, prompt, prompt_ids, sampling, queued_at, memory_room, adapter
        )
        stream = submit(self._worker, request_id, steps, session_id, aborted_delta(len(prompt_ids)))
        async for delta in stream:
            yield delta

    def _fork_steps(
        self,
        session_id: str,
        chunks: list[ChunkEncoding],
        prompt: Prompt,
        prompt_ids: torch.Tensor,
        sampling: SamplingParams,
        queued_at: float,
        memory_room: int | None,
        adapter: AnswerAdapter | None = None,
    ) -> Generator[GenerationDelta | None, None, None]:
        session = self._conversations.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} has no memory")
        prompt_ids, new, restart = turn_prompt(
            session, prompt, prompt_ids, self._decoding.tokenizer
        )
        ending = len(self._decoding.turn_end) if new is not None else 0
        session.check_room(len(prompt_ids) + sampling.max_tokens + ending, restart, memory_room)
        if restart:
            session.restart()
        fork = session.memory.fork()
        fork.set_query(prior_query(prompt, session.turns))
        for chunk in chunks:
            fork.import_chunk(chunk)
        generation = Generation(
            self._answering(MemoryState(fork, session.strategy)),
            prompt_ids,
            sampling,
            self._decoding.tokenizer,
            queued_at=queued_at,
            hold_final=True,
            adapter=adapter,
            **self._decoding.kwargs(),
        )
        final = yield from generation  # delegated: its decode steps join the worker's batches
        generated, answer = list(generation.output_ids), generation.text
        del fork, generation
        if new is not None:
            closing = self._decoding.turn_end
            generated += closing[1:] if generated and generated[-1:] == closing[:1] else closing
            session.add_turns(new, answer)
        _, hash_before = session.begin_turn()
        ids = torch.cat((prompt_ids, torch.tensor(generated, dtype=torch.long)))
        with torch.inference_mode():
            session.memory.append(ids)
        session.last_used = time.monotonic()
        limit = self._config.max_turn_encoding_bytes
        turn = session.finish_turn(restart, new, answer, hash_before, limit)
        if final is not None:
            yield dataclasses.replace(final, turns=session.take_unsent(turn))
