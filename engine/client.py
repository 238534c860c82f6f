"""`LocalEngine`: the in-process EngineClient. Async calls in, jobs on the device thread out.

Everything here that touches torch runs on the worker thread (engine/worker.py); the async methods
only tokenize, validate, queue and wait. Tokenizers mutate shared state while encoding (the
special-token switch), so the asyncio side and the device thread each use their own copy.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import importlib
import logging
import re
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Generator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch

from engine.config import EngineConfig
from engine.generate import Generation, KVCacheState, MemoryState, generate_steps, step_batch
from engine.loader import LoadedModel, load_model
from engine.protocol import (
    CollectionAttachment,
    CollectionIncompatible,
    CollectionNotFound,
    EngineHealth,
    EngineStats,
    GenerationDelta,
    IngestProgress,
    InvalidRequest,
    MemorySpec,
    ModelInfo,
    Prompt,
    PromptTooLong,
    RequestStats,
    SamplingParams,
    SessionMemoryInfo,
    SessionNotFound,
    StoreUnavailableError,
)
from engine.store import StoreBridge, document_id, model_fingerprint, session_fingerprint
from engine.store import ingest_steps as store_ingest_steps
from engine.worker import Collector, Job, Steps, Worker
from memory_store.client import MemoryStoreClient
from memory_store.encodings import ChunkEncoding, ChunkRef
from memory_store.errors import InvalidStoreRequest, NotFound, StoreError

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
_ROLE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,31}")
_PLACEHOLDER = "\ue000{}\ue001"  # private-use characters: never produced by a chat template
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)\ue001")


def memory_module() -> ModuleType | None:
    """engine.memory.session if it is installed, else None (imported lazily: it is optional)."""
    try:
        return importlib.import_module("engine.memory.session")
    except ModuleNotFoundError as e:
        if e.name in ("engine.memory", "engine.memory.session"):
            return None
        raise


def end_token_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    """EOS and the chat template's end-of-turn tokens: generating one ends with "stop"."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update(int(i) for i in ([gen_eos] if isinstance(gen_eos, int) else gen_eos))
    added = tokenizer.get_added_vocab()
    ids.update(added[t] for t in _END_OF_TURN_TOKENS if t in added)
    return frozenset(ids)


def _message_text(message: Any, index: int) -> tuple[str, str]:
    """(role, content text) of one chat message; content may be a str or a list of text parts."""
    if not isinstance(message, Mapping):
        raise InvalidRequest(f"message {index} must be an object", param="messages")
    role = message.get("role")
    if not isinstance(role, str) or not _ROLE.fullmatch(role):
        raise InvalidRequest(f"message {index} has an invalid role", param="messages")
    content = message.get("content")
    if content is None:
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise InvalidRequest(
                    f"message {index}: only text content parts are supported", param="messages"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"message {index}: a text part needs text", param="messages")
            texts.append(text)
        return role, "\n".join(texts)
    raise InvalidRequest(f"message {index} content must be a string or a list", param="messages")


Turn = tuple[str, str]
"""One chat message as a session remembers it: (role, content text)."""


def message_turns(messages: Sequence[Any]) -> list[Turn]:
    """(role, text) of each message; InvalidRequest for malformed ones."""
    if isinstance(messages, str | bytes) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    return [_message_text(message, i) for i, message in enumerate(messages)]


def _render(tokenizer: Any, turns: Sequence[Turn], offset: int, generation_prompt: bool) -> str:
    """The chat template around placeholders: turn i's content is placeholder offset + i."""
    templated = [
        {"role": role, "content": _PLACEHOLDER.format(offset + i)}
        for i, (role, _) in enumerate(turns)
    ]
    try:
        return str(
            tokenizer.apply_chat_template(
                templated, tokenize=False, add_generation_prompt=generation_prompt
            )
        )
    except Exception as e:  # templates raise on role orders they do not support
        raise InvalidRequest(f"chat template rejected the messages: {e}", param="messages") from e


def _tokenize_rendered(tokenizer: Any, rendered: str, contents: Sequence[str]) -> list[int]:
    """Token ids of a rendered template: its own text with special tokens recognised, each
    placeholder's content with split_special_tokens=True (so it never becomes control tokens)."""
    ids: list[int] = []
    pos = 0
    for match in _PLACEHOLDER_RE.finditer(rendered):
        if match.start() > pos:
            ids += tokenizer(rendered[pos : match.start()], add_special_tokens=False).input_ids
        content = contents[int(match.group(1))]
        if content:
            ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True).input_ids
        pos = match.end()
    if pos < len(rendered):
        ids += tokenizer(rendered[pos:], add_special_tokens=False).input_ids
    return ids


def encode_chat(tokenizer: Any, messages: Sequence[Any], history: Sequence[Turn] = ()) -> list[int]:
    """Token ids of chat messages rendered by the chat template, with a generation prompt.

    With a history (the turns a session's memory already holds), only the continuation is
    encoded: the template rendered over history + messages, minus its rendering of the history
    alone. So what a template adds once per conversation (SmolLM2's default system prompt when
    the first message is not a system message) is not repeated in the middle of a session. A
    template whose rendering of the history is not a prefix of the whole (one that rewrites
    earlier turns) gets the messages rendered on their own.

    Message contents never become control tokens: the template is rendered around placeholders,
    the template's own text is tokenized with special tokens recognised, and each content is
    tokenized with split_special_tokens=True, so a user typing "<|im_start|>system" gets text.
    """
    if isinstance(messages, str | bytes) or not (messages or history):
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    turns = [_message_text(message, i) for i, message in enumerate(messages)]
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this model has no chat template; use completions", param="messages")
    contents = [text for _, text in history] + [text for _, text in turns]
    rendered = _render(tokenizer, [*history, *turns], 0, True)
    if history:
        before = _render(tokenizer, history, 0, False)
        if rendered.startswith(before):
            rendered = rendered[len(before) :]
        else:
            rendered = _render(tokenizer, turns, len(history), True)
    return _tokenize_rendered(tokenizer, rendered, contents)


def assistant_turn_end(tokenizer: Any) -> list[int]:
    """Token ids the chat template puts after an assistant message's content (SmolLM2:
    "<|im_end|>\n"): what closes a generated answer in a session's memory, so that the next
    turn follows the template. Empty for a model without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    turns = [("user", ""), ("assistant", "")]
    try:
        rendered = _render(tokenizer, turns, 0, False)
    except InvalidRequest:
        return []
    end = _PLACEHOLDER.format(1)
    if end not in rendered:
        return []
    closing = rendered[rendered.index(end) + len(end) :]
    return list(tokenizer(closing, add_special_tokens=False).input_ids) if closing else []


def _on_abort(prompt_tokens: int) -> Any:
    """The delta that ends an aborted request."""

    def on_abort(last: GenerationDelta | None) -> GenerationDelta:
        return GenerationDelta(
            text="",
            token_ids=[],
            prompt_tokens=prompt_tokens,
            completion_tokens=last.completion_tokens if last is not None else 0,
            finish_reason="abort",
            stats=RequestStats(queue_seconds=0.0),
        )

    return on_abort


def _default_query_encoder() -> Any:
    from memory_store.embedder import default_embedder

    return default_embedder()


def _validate_sampling(sampling: SamplingParams) -> None:
    def bad(msg: str, param: str) -> InvalidRequest:
        return InvalidRequest(msg, param=param)

    if sampling.max_tokens < 1:
        raise bad("max_tokens must be at least 1", "max_tokens")
    if not sampling.temperature >= 0.0:
        raise bad("temperature must be >= 0", "temperature")
    if not 0.0 < sampling.top_p <= 1.0:
        raise bad("top_p must be in (0, 1]", "top_p")
    if sampling.top_k < 0:
        raise bad("top_k must be >= 0 (0 disables it)", "top_k")
    if not 0 <= sampling.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    if not all(isinstance(s, str) for s in sampling.stop):
        raise bad("stop must be a list of strings", "stop")


@dataclass
class _Collection:
    """A collection attached to a session. `order` maps each chunk's chain hash to its place
    in the collection (document order), to put a query's selection back in reading order."""

    attachment: CollectionAttachment
    order: dict[str, int]


@dataclass
class _Session:
    """A session's memory and the conversation it holds (device thread only)."""

    memory: Any  # engine.memory.session.SessionMemory
    strategy: str
    # Every chat message the memory holds, in order, each request's messages followed by the
    # answer generated for them (see LocalEngine._session_steps).
    turns: list[Turn] = dataclasses.field(default_factory=list)
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    collections: dict[str, _Collection] = dataclasses.field(default_factory=dict)

    @property
    def selected(self) -> list[_Collection]:
        """Collections searched per request (too large to load whole)."""
        return [c for c in self.collections.values() if c.attachment.loading == "selected"]


def query_text(prompt: Prompt) -> str:
    """EmbQ's input x: the last user message of a chat (what the question is), or a
    completion prompt's text."""
    if isinstance(prompt, str):
        return prompt
    for i in range(len(prompt) - 1, -1, -1):
        role, text = _message_text(prompt[i], i)
        if role == "user":
            return text
    return _message_text(prompt[-1], len(prompt) - 1)[1]


class _OutputStream:
    """Async iterator over one job's outputs. Leaving early (aclose, cancellation, garbage
    collection) aborts the job in the worker."""

    def __init__(self, worker: Worker, request_id: str, collector: Collector) -> None:
        self._worker = worker
        self._request_id = request_id
        self._collector = collector
        self._done = False

    def __aiter__(self) -> _OutputStream:
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        try:
            has_item, item = await self._collector.get()
        except asyncio.CancelledError:
            self._close()
            raise
        except BaseException:
            self._done = True
            raise
        if not has_item:
            self._done = True
            raise StopAsyncIteration
        return item

    def _close(self) -> None:
        if not self._done:
            self._done = True
            if not self._collector.closed:
                self._worker.abort(self._request_id)

    async def aclose(self) -> None:
        self._close()

    def __del__(self) -> None:
        self._close()


class LocalEngine:
    """The in-process engine: a loaded model, one device thread, and the sessions' memories."""

    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None):
        self.config = config or EngineConfig()
        self.loaded = loaded or load_model(self.config)
        self._tokenizer = self.loaded.tokenizer  # asyncio side: prompts
        self._device_tokenizer = copy.deepcopy(self.loaded.tokenizer)  # device thread
        self._tokenizer_lock = threading.Lock()
        self._end_ids = end_token_ids(self._tokenizer, self.loaded.model)
        self._turn_end = assistant_turn_end(self._tokenizer)  # closes an answer in a session
        self._vocab_size = len(self._tokenizer)
        self._sessions: dict[str, _Session] = {}  # written on the device thread only
        self._ingest_ids: set[str] = set()  # running ingestions (drop_session fails them)
        mem = memory_module()
        self._info = ModelInfo(
            id=self.loaded.model_id,
            max_model_len=self.loaded.max_model_len,
            strategies=(tuple(mem.STRATEGIES) if mem is not None else ()) + ("larimar",),
            created=int(time.time()),
        )
        offload_after = self.config.session_offload_after_s
        self._worker = Worker(
            self.config.max_waiting_requests,
            self.config.max_running_requests,
            run_batch=self._step_batch,
            housekeeping=self._offload_idle_sessions if offload_after > 0 else None,
            housekeeping_interval_s=min(max(offload_after / 4, 0.01), 10.0),
        )
        # The memory service (engine/store.py): None unless memory_store_url or data_dir is set.
        self._store = StoreBridge.from_config(self.config)
        self._model_fingerprint = (
            model_fingerprint(self.loaded.model_id, self.loaded.model) if self._store else ""
        )
        # Larimar sessions keep their memory in the memory service, read on the asyncio side.
        self._larimar_sessions: dict[str, MemorySpec] = {}
        self._larimar_reader: Any = None
        # EmbQ for collections too large to load whole; None: the bundled MiniLM (EmbD's).
        self._query_encoder: Any = None

    # -- tokenization (asyncio side) ----------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        with self._tokenizer_lock:
            if isinstance(prompt, str):
                return list(self._tokenizer(prompt).input_ids)
            return encode_chat(self._tokenizer, prompt)

    # -- EngineClient -------------------------------------------------------------------------

    @property
    def model(self) -> ModelInfo:
        return self._info

    def generate(
        self,
        request_id: str,
        prompt: Prompt,
        sampling: SamplingParams,
        *,
        session_id: str | None = None,
        memory: MemorySpec | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        self._worker.check_alive()
        _validate_sampling(sampling)
        if session_id in self._larimar_sessions:
            return self._larimar_generate(
                request_id, prompt, sampling, session_id, self._larimar_sessions[session_id]
            )
        ids = self.encode_prompt(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        prompt_ids = torch.tensor(ids, dtype=torch.long)  # (T,)
        total = len(ids) + sampling.max_tokens
        queued_at = time.perf_counter()

        steps: Steps
        if session_id is not None:
            if memory_module() is None or session_id not in self._sessions:
                raise SessionNotFound(f"session {session_id!r} has no memory")
            session = self._sessions[session_id]
            self._check_memory_cap(session.memory.num_tokens + total)
            if session.selected:
                return self._selected_generate(
                    request_id, prompt, prompt_ids, sampling, session_id, queued_at
                )
            steps = self._session_steps(session_id, prompt, prompt_ids, sampling, queued_at)
        elif total <= self.loaded.max_model_len:
            steps = self._kv_steps(prompt_ids, sampling, queued_at)
        else:
            mem = memory_module()
            if mem is None:
                raise PromptTooLong(
                    f"This model's maximum context length is {self.loaded.max_model_len} tokens. "
                    f"However, you requested {total} tokens ({len(ids)} in the prompt, "
                    f"{sampling.max_tokens} in the completion).",
                    param="messages" if not isinstance(prompt, str) else "prompt",
                )
            self._check_memory_cap(total)
            spec = memory or MemorySpec(strategy=self.config.memory_strategy)
            if spec.strategy == "larimar":
                return self._larimar_generate(request_id, prompt, sampling, None, spec)
            self._check_strategy(mem, spec)
            steps = self._ephemeral_steps(mem, spec, prompt_ids, sampling, queued_at)

        return self._submit(request_id, steps, session_id, _on_abort(len(ids)))

    # -- collections (Decoupled Context Processing: encodings stored once, loaded by EmbQ) ---

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

    async def attach_collection(self, session_id: str, name: str) -> CollectionAttachment:
        """Attach `name` (written by `longserve ingest`) to the session.

        Its chunks must carry this session's fingerprint (model + strategy + memory knobs):
        encodings made under another configuration mean something else to this frame. A
        collection of at most `collection_max_chunks` chunks is read whole now, in document
        order, by `import_chunk` (no forward): everything is fetched before anything is
        imported, so a store failure changes nothing. A larger one is only recorded here; each
        request then loads its EmbQ selection (`_selected_generate`).
        """
        self._worker.check_alive()
        if session_id in self._larimar_sessions:
            raise CollectionIncompatible(
                "a larimar session keeps no encodings; collections "
                "attach to segments, tokens and neurocache sessions"
            )
        session = self._sessions.get(session_id)
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
        if len(refs) > self.config.collection_max_chunks:
            attached = CollectionAttachment(name, len(refs), 0, "selected")

            def record() -> None:
                session.collections[name] = _Collection(attached, order)

            await self._on_device(record)
            return attached
        chunks = await self._fetch_chunks(refs)
        tokens = sum(chunk.num_tokens for chunk in chunks)
        self._check_memory_cap(session.memory.num_tokens + tokens)
        attached = CollectionAttachment(name, len(refs), tokens, "whole")

        def load() -> None:
            if self._sessions.get(session_id) is not session:
                raise SessionNotFound(f"session {session_id!r} was dropped")
            if name in session.collections:
                return
            for chunk in chunks:
                session.memory.import_chunk(chunk)
            session.collections[name] = _Collection(attached, order)

        await self._on_device(load)
        return attached

    async def _select(self, session: _Session, prompt: Prompt) -> list[ChunkEncoding]:
        """EmbQ(x) . EmbD(c) top-k of each selected collection, in document order."""
        bridge = self._bridge()
        encoder = self._query_encoder or _default_query_encoder()
        query = await asyncio.to_thread(encoder.embed, [query_text(prompt)])  # (1, d)
        picked: list[tuple[int, int, ChunkRef]] = []
        for rank, collection in enumerate(session.selected):
            name = collection.attachment.name
            try:
                select = functools.partial(
                    bridge.client.select_chunks, name, query[0], self.config.collection_top_k
                )
                refs = await bridge.acall("select_chunks", select)
            except InvalidStoreRequest as e:  # EmbQ and EmbD from different encoders
                raise CollectionIncompatible(f"collection {name!r}: {e}") from e
            except NotFound as e:
                raise CollectionNotFound(f"collection {name!r} is no longer stored") from e
            picked += [(rank, collection.order.get(r.chain_hash, 0), r) for r in refs]
        picked.sort(key=lambda p: (p[0], p[1]))
        return await self._fetch_chunks([ref for _, _, ref in picked])

    async def _selected_generate(
        self,
        request_id: str,
        prompt: Prompt,
        prompt_ids: torch.Tensor,
        sampling: SamplingParams,
        session_id: str,
        queued_at: float,
    ) -> AsyncIterator[GenerationDelta]:
        """A request on a session with a large collection: select, then generate on a fork.

        The selected chunks are read into a fork of the session's memory made for this request
        (after the session's own documents and turns, just before the question), never into
        the session's memory itself: the next question selects its own chunks, and a memory
        that kept every selection would grow into the whole collection and fill its frame with
        chunks picked for earlier questions. Re-forking per request (rather than caching a fork
        per selection) costs one copy of the session's own tensors and no forward; a cache
        could not be reused anyway, since every turn changes the session. The turn (question
        and answer) then joins the session's own memory, one forward over its tokens, so later
        questions can refer to it as in any session.
        """
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} has no memory")
        chunks = await self._select(session, prompt)
        selected_tokens = sum(c.num_tokens for c in chunks)
        self._check_memory_cap(
            session.memory.num_tokens + selected_tokens + len(prompt_ids) + sampling.max_tokens
        )
        steps = self._fork_steps(session_id, chunks, prompt, prompt_ids, sampling, queued_at)
        async for delta in self._submit(request_id, steps, session_id, _on_abort(len(prompt_ids))):
            yield delta

    def _fork_steps(
        self,
        session_id: str,
        chunks: list[ChunkEncoding],
        prompt: Prompt,
        prompt_ids: torch.Tensor,
        sampling: SamplingParams,
        queued_at: float,
    ) -> Generator[GenerationDelta | None, None, None]:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} has no memory")
        prompt_ids, new = self._turn_prompt(session, prompt, prompt_ids)
        fork = session.memory.fork()
        for chunk in chunks:
            fork.import_chunk(chunk)
        generated: list[int] = []
        answer: list[str] = []
        state = MemoryState(fork, session.strategy)
        for delta in generate_steps(
            state,
            prompt_ids,
            sampling,
            self._device_tokenizer,
            queued_at=queued_at,
            **self._decode_kwargs(),
        ):
            if delta is not None:
                generated += delta.token_ids
                answer.append(delta.text)
            yield delta
        del fork, state
        if new is not None:
            closing = self._turn_end
            generated += closing[1:] if generated and generated[-1:] == closing[:1] else closing
            session.turns = [*session.turns, *new, ("assistant", "".join(answer))]
        turn = torch.cat((prompt_ids, torch.tensor(generated, dtype=torch.long)))
        with torch.inference_mode():
            session.memory.append(turn)
        session.last_used = time.monotonic()

    def _submit(
        self, request_id: str, steps: Steps, session_id: str | None, on_abort: Any
    ) -> _OutputStream:
        collector = Collector(asyncio.get_running_loop())
        job = Job(request_id, steps, collector, session_id=session_id, on_abort=on_abort)
        try:
            self._worker.submit(job)
        except BaseException:
            steps.close()
            raise
        return _OutputStream(self._worker, request_id, collector)

    def _check_memory_cap(self, tokens: int) -> None:
        if tokens > self.config.max_memory_tokens:
            raise PromptTooLong(
                f"the request needs {tokens} tokens of memory; the limit is "
                f"{self.config.max_memory_tokens}",
                param="messages",
            )

    @staticmethod
    def _check_strategy(mem: ModuleType, spec: MemorySpec) -> None:
        if spec.strategy not in mem.STRATEGIES:
            raise InvalidRequest(
                f"unknown memory strategy {spec.strategy!r}; expected one of {mem.STRATEGIES}",
                param="memory",
            )

    def _decode_kwargs(self) -> dict[str, Any]:
        return {
            "stop_token_ids": self._end_ids,
            "prefill_chunk_tokens": self.config.prefill_chunk_tokens,
            "vocab_size": self._vocab_size,
        }

    # The *_steps generators run on the device thread.

    def _kv_steps(
        self, prompt_ids: torch.Tensor, sampling: SamplingParams, queued_at: float
    ) -> Generation:
        # Nothing runs until the worker steps it; its decode steps join the worker's batches.
        state = KVCacheState(self.loaded.model, max_tokens=len(prompt_ids) + sampling.max_tokens)
        return Generation(
            state,
            prompt_ids,
            sampling,
            self._device_tokenizer,
            queued_at=queued_at,
            **self._decode_kwargs(),
        )

    def _step_batch(
        self, generations: list[Generation]
    ) -> list[GenerationDelta | None | Exception]:
        return step_batch(self.loaded.model, generations)

    def _ephemeral_steps(
        self,
        mem: ModuleType,
        spec: MemorySpec,
        prompt_ids: torch.Tensor,
        sampling: SamplingParams,
        queued_at: float,
    ) -> Generator[GenerationDelta | None, None, None]:
        state = MemoryState(mem.SessionMemory(self.loaded.model, spec), spec.strategy)
        yield from generate_steps(
            state,
            prompt_ids,
            sampling,
            self._device_tokenizer,
            queued_at=queued_at,
            **self._decode_kwargs(),
        )

    def _session_steps(
        self,
        session_id: str,
        prompt: Prompt,
        prompt_ids: torch.Tensor,
        sampling: SamplingParams,
        queued_at: float,
    ) -> Generator[GenerationDelta | None, None, None]:
        """One request on a session's memory. Runs when the session's previous request has
        finished (the worker runs a session's jobs one at a time), so it sees its last turn.

        Chat messages: when they start with exactly the turns the memory already holds (role
        and content compared message by message; a client resending the whole conversation),
        only the messages after those are appended; otherwise (a client sending only its new
        question, or an edited history) all of them are, as sent. Either way they are rendered
        as the continuation of the conversation held, and the answer is closed with the
        template's end of turn. A completion prompt is appended as it is.
        """
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} has no memory")
        prompt_ids, new = self._turn_prompt(session, prompt, prompt_ids)
        self._check_memory_cap(session.memory.num_tokens + len(prompt_ids) + sampling.max_tokens)
        tokens_before = session.memory.num_tokens
        generation = generate_steps(
            MemoryState(session.memory, session.strategy),
            prompt_ids,
            sampling,
            self._device_tokenizer,
            queued_at=queued_at,
            **self._decode_kwargs(),
        )
        answer: list[str] = []
        try:
            for delta in generation:
                if delta is not None:
                    answer.append(delta.text)
                yield delta
        finally:  # finished, failed or aborted: the memory keeps what it read, turn closed
            if self._sessions.get(session_id) is session:
                self._end_turn(session, generation, tokens_before, new, "".join(answer))
                session.memory.end_request()

    def _turn_prompt(
        self, session: _Session, prompt: Prompt, prompt_ids: torch.Tensor
    ) -> tuple[torch.Tensor, list[Turn] | None]:
        """What a request appends to a session (device thread): a completion prompt as it is;
        chat messages past the turns the session holds when they start with exactly those,
        else all of them, rendered as the conversation's continuation. Returns the ids (T,)
        and the chat messages appended (None for a completion)."""
        if isinstance(prompt, str):
            return prompt_ids, None
        sent = message_turns(prompt)
        held = session.turns
        new = sent[len(held) :] if sent[: len(held)] == held else sent
        ids = encode_chat(self._device_tokenizer, prompt[len(sent) - len(new) :], held)
        return torch.tensor(ids, dtype=torch.long), new

    def _end_turn(
        self,
        session: _Session,
        generation: Generation,
        tokens_before: int,
        new: list[Turn] | None,
        answer: str,
    ) -> None:
        """After a request on a session: read the last sampled token (not yet read) and, for
        chat, the template's end of turn into the memory, and remember the turns it holds."""
        session.last_used = time.monotonic()
        if session.memory.num_tokens == tokens_before:
            return  # stopped before reading anything
        tail = [generation.next_token] if generation.next_token is not None else []
        if new is not None:
            closing = self._turn_end
            tail += closing[1:] if tail and closing and tail[-1] == closing[0] else closing
            session.turns = [*session.turns, *new, ("assistant", answer)]
        if not tail:
            return
        try:
            with torch.inference_mode():
                session.memory.append(torch.tensor(tail, dtype=torch.long))
        except Exception:
            logger.exception("closing a turn of a session failed")

    async def count_tokens(self, prompt: Prompt) -> int:
        return len(self.encode_prompt(prompt))

    async def abort(self, request_id: str) -> None:
        self._worker.abort(request_id)

    async def _on_device(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self._worker.call(fn))

    async def create_session(self, session_id: str, memory: MemorySpec | None = None) -> None:
        mem = memory_module()
        if mem is None:
            raise InvalidRequest("session memory is not available in this engine", param="memory")
        spec = memory or MemorySpec(strategy=self.config.memory_strategy)
        if spec.strategy == "larimar":
            from engine.larimar import parse_larimar_spec

            parse_larimar_spec(spec)
            if session_id in self._larimar_sessions or session_id in self._sessions:
                raise InvalidRequest(f"session {session_id!r} already exists", param="session_id")
            self._larimar_sessions[session_id] = spec
            return
        self._check_strategy(mem, spec)

        def create() -> None:
            if session_id in self._sessions:
                raise InvalidRequest(f"session {session_id!r} already exists", param="session_id")
            self._sessions[session_id] = _Session(
                mem.SessionMemory(self.loaded.model, spec), spec.strategy
            )

        await self._on_device(create)

    async def drop_session(self, session_id: str) -> None:
        if self._larimar_sessions.pop(session_id, None) is not None:
            return  # its memory lives in the memory service, which the server cleans up

        def drop() -> None:
            for request_id in self._worker.jobs_for_session(session_id):
                job_error = SessionNotFound(f"session {session_id!r} was dropped")
                is_ingest = request_id in self._ingest_ids
                self._worker.abort(request_id, job_error if is_ingest else None)
            self._sessions.pop(session_id, None)

        await self._on_device(drop)

    def ingest(self, request_id: str, session_id: str, text: str) -> AsyncIterator[IngestProgress]:
        self._worker.check_alive()
        if session_id in self._larimar_sessions:
            return self._larimar_ingest(session_id, text)
        if session_id not in self._sessions:
            raise SessionNotFound(f"session {session_id!r} has no memory")
        if not isinstance(text, str):
            raise InvalidRequest("text must be a string", param="text")
        return self._submit(
            request_id, self._ingest_steps(request_id, session_id, text), session_id, None
        )

    def _ingest_steps(
        self, request_id: str, session_id: str, text: str
    ) -> Generator[IngestProgress | None, None, None]:
        self._ingest_ids.add(request_id)
        session = self._sessions.get(session_id)
        try:
            started = time.perf_counter()
            if session is None:
                raise SessionNotFound(f"session {session_id!r} has no memory")
            ids = self._device_tokenizer(
                text, add_special_tokens=False, split_special_tokens=True
            ).input_ids
            self._check_memory_cap(session.memory.num_tokens + len(ids))
            yield IngestProgress(0, len(ids), time.perf_counter() - started, done=not ids)
            if self._store is not None and ids:
                yield from store_ingest_steps(
                    self._store,
                    self._model_fingerprint,
                    session.memory,
                    ids,
                    session_id=session_id,
                    doc_id=document_id(request_id),
                    decode=self._device_tokenizer.decode,
                    started=started,
                )
                return
            chunk = self.config.prefill_chunk_tokens
            doc = torch.tensor(ids, dtype=torch.long)  # (T,)
            for start in range(0, len(ids), chunk):
                with torch.inference_mode():
                    session.memory.append(doc[start : start + chunk], document=True)
                done = min(start + chunk, len(ids))
                yield IngestProgress(
                    done, len(ids), time.perf_counter() - started, done=done == len(ids)
                )
        finally:
            self._ingest_ids.discard(request_id)
            if session is not None:
                session.last_used = time.monotonic()

    # -- larimar (engine/larimar.py): the readout's sentences condition a plain generation -----

    def _larimar(self) -> Any:
        if self._larimar_reader is None:
            from engine.larimar import LarimarReader
            from memory_store.backends import EmbeddedBackend

            if self.config.memory_store_url is not None:
                client = MemoryStoreClient.http(
                    self.config.memory_store_url, timeout_s=self.config.memory_store_timeout_s
                )
                self._larimar_reader = LarimarReader(client)
            else:
                root = (
                    Path(self.config.data_dir)
                    if self.config.data_dir is not None
                    else Path(tempfile.mkdtemp(prefix="longserve-larimar-"))
                )
                self._larimar_reader = LarimarReader.in_process(
                    EmbeddedBackend(root / "memory-store")
                )
        return self._larimar_reader

    async def _larimar_generate(
        self,
        request_id: str,
        prompt: Prompt,
        sampling: SamplingParams,
        session_id: str | None,
        spec: MemorySpec,
    ) -> AsyncIterator[GenerationDelta]:
        from engine.larimar import split_context

        reader = self._larimar().with_spec(spec)
        started = time.perf_counter()
        if session_id is None:  # a long prompt: its context goes to a throwaway memory
            session_id = f"ephemeral-{request_id}-{uuid.uuid4().hex}"
            context, prompt = split_context(prompt)
            await reader.write(session_id, context)
        try:
            conditioned = await reader.conditioned_prompt(session_id, prompt)
        except StoreError as e:
            raise StoreUnavailableError(f"larimar read failed: {e}") from e
        retrieval = time.perf_counter() - started
        async for delta in self.generate(request_id, conditioned, sampling):
            if delta.stats is not None:
                delta = dataclasses.replace(
                    delta,
                    stats=dataclasses.replace(
                        delta.stats, strategy="larimar", retrieval_seconds=retrieval
                    ),
                )
            yield delta

    async def _larimar_ingest(self, session_id: str, text: str) -> AsyncIterator[IngestProgress]:
        started = time.perf_counter()
        tokens = await asyncio.to_thread(lambda: len(self.encode_prompt(text)))
        yield IngestProgress(0, tokens, time.perf_counter() - started)
        try:
            await self._larimar().write(session_id, text)
        except StoreError as e:
            raise StoreUnavailableError(f"larimar write failed: {e}") from e
        yield IngestProgress(tokens, tokens, time.perf_counter() - started, done=True)

    async def health(self) -> EngineHealth:
        if self._worker.dead is not None:
            return EngineHealth(ok=False, detail=f"engine worker died: {self._worker.dead!r}")
        if not self._worker.is_alive():
            return EngineHealth(ok=False, detail="engine is shut down")
        return EngineHealth(ok=True, detail=f"{self._info.id} on {self.loaded.device}")

    def stats(self) -> EngineStats:
        sessions = list(self._sessions.values())
        return EngineStats(
            num_requests_running=self._worker.num_running,
            num_requests_waiting=self._worker.num_waiting,
            sessions_active=len(sessions),
            memory_tokens=sum(int(s.memory.num_tokens) for s in sessions),
            sessions_offloaded=sum(1 for s in sessions if s.memory.offloaded),
        )

    def session_memory_info(self, session_id: str) -> SessionMemoryInfo | None:
        session = self._sessions.get(session_id)
        if session is None:
            return None
        memory = session.memory
        tier: Literal["device", "host"] = (
            "host" if memory.offloaded or memory.config.tier == "host" else "device"
        )
        return SessionMemoryInfo(tokens=int(memory.num_tokens), tier=tier)

    def _offload_idle_sessions(self) -> None:
        """Worker housekeeping (device thread): move sessions idle for session_offload_after_s
        to host memory. A session with a request or ingestion in flight is not idle; its
        memory moves back by itself on its next append."""
        now = time.monotonic()
        busy = self._worker.busy_sessions()
        for session_id, session in list(self._sessions.items()):
            if session_id in busy:
                session.last_used = now
            elif (
                not session.memory.offloaded
                and now - session.last_used >= self.config.session_offload_after_s
            ):
                session.memory.offload()
                logger.info("session %s idle: its memory moved to host memory", session_id)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self._worker.stop)
        self._sessions.clear()
        if self._store is not None:
            await asyncio.to_thread(self._store.close)
