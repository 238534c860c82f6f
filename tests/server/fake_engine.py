"""A deterministic EngineClient for the server tests: no model, no torch.

Generation: with temperature 0 (or no seed) the engine echoes the words of the last message /
the prompt, one word-token per delta, and stops ("stop") after echoing them once unless
ignore_eos; with a seed it draws words from a small vocabulary with random.Random(seed).
Every test knob is a plain attribute: `overloaded`, `dead`, `fail_after_tokens`, `gate`.
`tool_format`: the tool syntax its ModelInfo says the chat template speaks (None by default).

Sessions: create_session refuses unknown strategies (InvalidRequest); ingest counts one token
per word and reports progress per chunk of `ingest_chunk_tokens`, sleeping `ingest_delay` and
waiting on `ingest_gate` before each chunk; it stops with SessionNotFound when its session is
dropped and records closed-early ingestions in `ingest_cancelled`.

Encodings: each ingested chunk is one "model forward" (counted in `forwards`, per session in
`forwards_by_session`), unless `encodings` (a dict standing in for the memory store's encoder
outputs, shareable between engines) already holds it under its prefix-chain hash; then it is
rebuilt from there and reported in `IngestProgress.tokens_from_store`, like the real engine.

Collections: `collections` maps a name to (fingerprint, chunks, tokens), what `longserve
ingest` would have stored; `attach_collection` checks the session's `fingerprint(memory)`
against it (CollectionIncompatible) and records attachments in `attached`. A collection of more
than `collection_max_chunks` chunks is attached "selected" (loads nothing).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from engine.protocol import (
    AlternativeLogprob,
    CollectionAttachment,
    CollectionIncompatible,
    CollectionNotFound,
    EngineDead,
    EngineError,
    EngineHealth,
    EngineOverloaded,
    EngineStats,
    GenerationDelta,
    IngestProgress,
    InvalidRequest,
    MemoryBudgetExceeded,
    MemorySpec,
    ModelInfo,
    PreparedPrompt,
    Prompt,
    RequestStats,
    SamplingParams,
    SessionMemoryInfo,
    SessionNotFound,
    SessionTurn,
    StoreUnavailableError,
    Tokenized,
    TokenizerInfo,
    TokenLogprob,
    TokenPrompt,
    ToolFormat,
    TooManyTokens,
)

VOCAB = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
STRATEGIES = ("segments", "tokens", "neurocache")


@dataclass(frozen=True)
class Call:
    request_id: str
    prompt: Prompt
    sampling: SamplingParams
    session_id: str | None
    memory: MemorySpec | None
    tenant: str | None = None
    adapter: str | None = None


def prompt_words(prompt: Prompt) -> list[str]:
    if isinstance(prompt, str):
        return prompt.split()
    return " ".join(str(m.get("content") or "") for m in prompt).split()


def last_text(prompt: Prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return str(prompt[-1].get("content") or "")


class FakeEngine:
    def __init__(
        self,
        model_id: str = "fake-model",
        token_delay: float = 0.0,
        encodings: dict[str, int] | None = None,
        tool_format: ToolFormat | None = None,
    ) -> None:
        self._model = ModelInfo(
            id=model_id,
            max_model_len=2048,
            strategies=STRATEGIES,
            created=1_700_000_000,
            tool_format=tool_format,
            adapters=(f"{model_id}:recall",),
        )
        self.token_delay = token_delay
        self.calls: list[Call] = []
        self.aborted: set[str] = set()
        self.finished: set[str] = set()
        self.running: set[str] = set()
        self.sessions: set[str] = set()
        self.turns: dict[str, tuple[int, int, int]] = {}  # session -> seq, turns, turn tokens
        self.hashes: dict[str, str] = {}  # session -> its memory's hash after its last turn
        self.imported: list[tuple[str, SessionTurn]] = []
        self.overloaded = False
        self.dead = False
        self.fail_after_tokens: int | None = None
        self.shutdown_called = False
        # Cleared: every request waits before each token until it is set again.
        self.gate = asyncio.Event()
        self.gate.set()
        self.first_token_sent = asyncio.Event()
        self._abort_requested: set[str] = set()
        self.session_memory: dict[str, MemorySpec | None] = {}
        self.ingest_chunk_tokens = 4
        self.ingest_delay = 0.0
        self.ingest_gate = asyncio.Event()  # cleared: ingestion waits before each chunk
        self.ingest_gate.set()
        self.ingest_started = asyncio.Event()
        self.ingest_fail_after_chunks: int | None = None
        self.ingested: dict[str, list[str]] = {}  # session id -> documents read, in order
        self.ingest_running: set[str] = set()
        self.ingest_cancelled: set[str] = set()
        self.dropped: list[str] = []
        self.encodings = encodings  # chain hash -> tokens of the chunk
        self.forwards = 0
        self.cached_tokens = 0  # what every delta reports as read from a reused prefix
        # Set: ingestion reads everything into memory, then ends with StoreUnavailableError
        # (the real engine's answer when the store failed under it).
        self.store_unavailable = False
        self.forwards_by_session: dict[str, int] = {}
        self.offloaded: set[str] = set()  # sessions a test says are in host memory
        self.memory_tokens = 123  # what stats() says the sessions' memories hold
        self.collections: dict[str, tuple[str, int, int]] = {}
        self.collection_max_chunks = 64
        self.attached: dict[str, list[str]] = {}  # session id -> collections, in order
        self.prepared: list[tuple[Prompt, str | None]] = []  # prepare()'s prompts and tenants
        self.tokenized: list[tuple[Prompt, str | None]] = []  # tokenize()'s
        self.vocabulary: dict[str, int] = {}  # tokenize()'s words, by id

    @property
    def model(self) -> ModelInfo:
        return self._model

    async def prepare(
        self,
        prompt: Prompt | TokenPrompt,
        sampling: SamplingParams,
        *,
        tenant: str | None = None,
        token_limit: int | None = None,
    ) -> PreparedPrompt:
        self.prepared.append((prompt, tenant))
        if isinstance(prompt, TokenPrompt):  # the ids' words, as tokenize numbered them
            words_of = list(self.vocabulary)
            bad = [i for i, t in enumerate(prompt.ids) if not 0 <= t < len(words_of)]
            if bad:
                raise InvalidRequest(f"prompt[{bad[0]}] is not a token id", param="prompt")
            prompt = " ".join(words_of[t] for t in prompt.ids)
        words = len(prompt_words(prompt))
        if token_limit is not None and words > token_limit:
            raise TooManyTokens(token_limit + 1, token_limit)  # stops at the first one past
        return PreparedPrompt(prompt, words)

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
        if isinstance(prompt, PreparedPrompt):
            prompt = prompt.prompt
        if self.dead:
            raise EngineDead("fake engine is dead")
        if self.overloaded:
            raise EngineOverloaded("waiting queue is full", retry_after=2.5)
        if memory is not None and memory.strategy not in STRATEGIES:
            raise InvalidRequest(f"unknown strategy {memory.strategy!r}", param="memory.strategy")
        if session_id is not None and session_id not in self.sessions:
            raise SessionNotFound(f"no session {session_id!r}")
        if adapter is not None and adapter not in self._model.adapters:
            raise InvalidRequest(f"no adapter model {adapter!r} is served", param="model")
        self.calls.append(Call(request_id, prompt, sampling, session_id, memory, tenant, adapter))
        if session_id is not None and memory_room is not None:
            grows = len(prompt_words(prompt)) + sampling.max_tokens
            if grows > memory_room:
                raise MemoryBudgetExceeded(f"needs {grows}, room {memory_room}", grows, memory_room)
        return self._run(request_id, prompt, sampling, memory, session_id)

    def _turn(self, session_id: str, request_id: str, tokens: int, answer: str) -> SessionTurn:
        """Like the real engine's: each finished request on a session takes one turn; the
        memory's hash chains every request read."""
        seq, held, held_tokens = self.turns.get(session_id, (0, 0, 0))
        before = self.hashes.get(session_id, "h0")
        turn = SessionTurn(
            seq=seq + 1,
            restart=False,
            messages=None,
            answer=answer,
            token_ids=list(range(tokens)),
            commits=[tokens],
            hash_before=before,
            hash_after=f"{before}/{request_id}",
            turns=held + 1,
            turn_tokens=held_tokens + tokens,
            encoding=b"fake-encoding-%d" % (seq + 1),
        )
        self.turns[session_id] = (turn.seq, turn.turns, turn.turn_tokens)
        self.hashes[session_id] = str(turn.hash_after)
        return turn

    async def import_turn(self, session_id: str, turn: SessionTurn) -> None:
        if session_id not in self.sessions:
            raise SessionNotFound(f"no session {session_id!r}")
        if turn.hash_before != self.hashes.get(session_id, "h0"):
            raise InvalidRequest(f"turn {turn.seq} does not follow", param="turn")
        self.imported.append((session_id, turn))
        self.turns[session_id] = (turn.seq, turn.turns, turn.turn_tokens)
        self.hashes[session_id] = str(turn.hash_after)

    def _words(self, prompt: Prompt, sampling: SamplingParams) -> tuple[list[str], bool]:
        """The words to emit and whether the last one is followed by EOS."""
        if sampling.temperature > 0 and sampling.seed is not None:
            rng = random.Random(sampling.seed)
            return [rng.choice(VOCAB) for _ in range(sampling.max_tokens)], False
        words = last_text(prompt).split() or ["empty"]
        if sampling.ignore_eos:
            return [words[i % len(words)] for i in range(sampling.max_tokens)], False
        return words, True

    async def _run(
        self,
        request_id: str,
        prompt: Prompt,
        sampling: SamplingParams,
        memory: MemorySpec | None,
        session_id: str | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        prompt_tokens = len(prompt_words(prompt))
        words, eos = self._words(prompt, sampling)
        text = ""
        emitted = 0
        done = False
        self.running.add(request_id)
        try:
            for i, word in enumerate(words[: sampling.max_tokens]):
                await self.gate.wait()
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                else:
                    await asyncio.sleep(0)
                if request_id in self._abort_requested:
                    done = True
                    yield GenerationDelta("", [], prompt_tokens, i, finish_reason="abort")
                    return
                if self.fail_after_tokens is not None and i >= self.fail_after_tokens:
                    raise EngineError("fake engine failed mid-generation")
                piece = word if i == 0 else " " + word
                candidate = text + piece
                stop_at = min(
                    (candidate.find(s) for s in sampling.stop if s in candidate), default=-1
                )
                last = i + 1 == min(len(words), sampling.max_tokens)
                finish = None
                if stop_at >= 0:
                    piece, finish = candidate[len(text) : stop_at], "stop"
                elif last:
                    finish = "stop" if eos and len(words) <= sampling.max_tokens else "length"
                text += piece
                emitted = i + 1
                logprobs = [self._logprob(word, sampling)] if sampling.logprobs else None
                stats = None
                if finish is not None:
                    strategy = memory.strategy if memory else "segments"
                    stats = RequestStats(
                        queue_seconds=0.001,
                        prefill_seconds=0.002,
                        retrieval_seconds=0.0005,
                        strategy=strategy,
                        memory_tokens=prompt_tokens,
                    )
                self.first_token_sent.set()
                done = finish is not None  # the consumer may close us at this last yield
                turns: tuple[SessionTurn, ...] = ()
                if done and session_id is not None:
                    turns = (self._turn(session_id, request_id, prompt_tokens + emitted, text),)
                yield GenerationDelta(
                    piece,
                    [1000 + i],
                    prompt_tokens,
                    emitted,
                    logprobs=logprobs,
                    finish_reason=finish,
                    stats=stats,
                    cached_tokens=self.cached_tokens,
                    turns=turns,
                )
                if done:
                    return
        finally:
            self.running.discard(request_id)
            if done:
                self.finished.add(request_id)
            else:
                self.aborted.add(request_id)  # closed early: the real engine aborts here

    @staticmethod
    def _logprob(word: str, sampling: SamplingParams) -> TokenLogprob:
        tops = [AlternativeLogprob(word, -0.25, list(word.encode()))]
        tops += [
            AlternativeLogprob(f"alt{j}", -2.0 - j, list(f"alt{j}".encode()))
            for j in range(max(0, sampling.top_logprobs - 1))
        ]
        return TokenLogprob(word, -0.25, list(word.encode()), tops[: sampling.top_logprobs])

    async def count_tokens(self, prompt: Prompt) -> int:
        return len(prompt_words(prompt))

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
        """Words are tokens, numbered as first seen; `<s>` opens a text prompt with special
        tokens, `<assistant>` ends chat messages with a generation prompt."""
        self.tokenized.append((prompt, tenant))
        words = prompt_words(prompt)
        if token_limit is not None and len(words) > token_limit:
            raise TooManyTokens(token_limit + 1, token_limit)
        if isinstance(prompt, str) and add_special_tokens:
            words.insert(0, "<s>")
        if not isinstance(prompt, str) and generation_prompt:
            words.append("<assistant>")
        for word in words:
            self.vocabulary.setdefault(word, len(self.vocabulary))
        ids = [self.vocabulary[w] for w in words]
        return Tokenized(ids, list(words) if token_strings else None)

    async def detokenize(self, token_ids: Sequence[int], *, tenant: str | None = None) -> str:
        words = list(self.vocabulary)
        for i, token in enumerate(token_ids):
            if not 0 <= token < len(words):
                raise InvalidRequest(f"tokens[{i}] is {token}, not a token id", param="tokens")
        return " ".join(words[t] for t in token_ids)

    @property
    def tokenizer_info(self) -> TokenizerInfo:
        return TokenizerInfo("FakeTokenizer", len(self.vocabulary), 2048, "<s>", "</s>")

    async def abort(self, request_id: str) -> None:
        self._abort_requested.add(request_id)

    async def create_session(self, session_id: str, memory: MemorySpec | None = None) -> None:
        if self.dead:
            raise EngineDead("fake engine is dead")
        if memory is not None and memory.strategy not in STRATEGIES:
            raise InvalidRequest(f"unknown strategy {memory.strategy!r}", param="memory.strategy")
        self.sessions.add(session_id)
        self.session_memory[session_id] = memory

    async def drop_session(self, session_id: str) -> None:
        self.sessions.discard(session_id)
        self.session_memory.pop(session_id, None)
        self.attached.pop(session_id, None)
        self.turns.pop(session_id, None)
        self.hashes.pop(session_id, None)
        self.dropped.append(session_id)

    def ingest(self, request_id: str, session_id: str, text: str) -> AsyncIterator[IngestProgress]:
        # Like the real engine: an unknown session fails at the call, before any iteration.
        if self.dead:
            raise EngineDead("fake engine is dead")
        if session_id not in self.sessions:
            raise SessionNotFound(f"session {session_id!r} has no memory")
        return self._ingest(request_id, session_id, text)

    async def _ingest(
        self, request_id: str, session_id: str, text: str
    ) -> AsyncIterator[IngestProgress]:
        words = text.split()
        total = len(words)
        chunk = max(1, self.ingest_chunk_tokens)
        done = 0
        from_store = 0
        chain = hashlib.sha256(self._model.id.encode()).hexdigest()
        finished = False
        self.ingest_running.add(request_id)
        self.ingest_started.set()
        try:
            finished = total == 0
            yield IngestProgress(0, total, 0.0, done=finished)
            chunks = 0
            while done < total:
                await self.ingest_gate.wait()
                await asyncio.sleep(self.ingest_delay)
                if session_id not in self.sessions:
                    raise SessionNotFound(f"session {session_id!r} was dropped")
                if (
                    self.ingest_fail_after_chunks is not None
                    and chunks >= self.ingest_fail_after_chunks
                ):
                    raise EngineError("fake engine failed while ingesting")
                piece = words[done : done + chunk]
                chain = hashlib.sha256(f"{chain}|{' '.join(piece)}".encode()).hexdigest()
                if self.encodings is not None and chain in self.encodings:
                    from_store += len(piece)
                else:
                    self.forwards += 1
                    self.forwards_by_session[session_id] = (
                        self.forwards_by_session.get(session_id, 0) + 1
                    )
                    if self.encodings is not None:
                        self.encodings[chain] = len(piece)
                done = min(total, done + chunk)
                chunks += 1
                finished = done == total
                if finished:
                    self.ingested.setdefault(session_id, []).append(text)
                    if self.store_unavailable:
                        raise StoreUnavailableError("fake memory store is down")
                yield IngestProgress(
                    done, total, 0.01 * chunks, done=finished, tokens_from_store=from_store
                )
            finished = True
        finally:
            self.ingest_running.discard(request_id)
            if not finished:
                self.ingest_cancelled.add(request_id)

    def session_memory_info(self, session_id: str) -> SessionMemoryInfo | None:
        if session_id not in self.sessions:
            return None
        tier = "host" if session_id in self.offloaded else "device"
        words = sum(len(text.split()) for text in self.ingested.get(session_id, []))
        return SessionMemoryInfo(tokens=words, tier=tier)

    def fingerprint(self, memory: MemorySpec | None) -> str:
        spec = memory or MemorySpec()
        return f"{self._model.id}/{spec.strategy}/{sorted(spec.params.items())}"

    async def attach_collection(self, session_id: str, name: str) -> CollectionAttachment:
        if self.dead:
            raise EngineDead("fake engine is dead")
        if session_id not in self.sessions:
            raise SessionNotFound(f"session {session_id!r} has no memory")
        if name not in self.collections:
            raise CollectionNotFound(f"collection {name!r} not found")
        fingerprint, chunks, tokens = self.collections[name]
        if fingerprint != self.fingerprint(self.session_memory.get(session_id)):
            raise CollectionIncompatible(f"collection {name!r} was encoded for another model")
        whole = chunks <= self.collection_max_chunks
        attached = self.attached.setdefault(session_id, [])
        if name not in attached:
            attached.append(name)
        return CollectionAttachment(
            name, chunks, tokens if whole else 0, "whole" if whole else "selected"
        )

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=not self.dead, detail="dead" if self.dead else "")

    def stats(self) -> EngineStats:
        return EngineStats(
            num_requests_running=len(self.running),
            num_requests_waiting=0,
            sessions_active=len(self.sessions),
            memory_tokens=self.memory_tokens,
            sessions_offloaded=len(self.offloaded & self.sessions),
            prefix_cache_hits=2,
            prefix_cache_tokens_reused=4096,
            prefix_cache_entries=1,
            prefix_cache_bytes=1 << 20,
            prefix_cache_store_hits=1,
            prefix_cache_store_tokens_imported=2048,
            prefix_cache_store_chunks_written=8,
        )

    async def shutdown(self) -> None:
        self.shutdown_called = True
