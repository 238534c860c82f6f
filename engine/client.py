"""`LocalEngine`: the in-process EngineClient. Async calls in, jobs on the device thread out.

Everything here that touches torch runs on the worker thread (engine/scheduler/worker.py); prompts
are tokenized and grammars compiled on the preprocessing threads (engine/scheduler/preprocess.py);
the async methods only validate, queue and wait (prompts are read by
engine/scheduler/prompts.py).
Sessions come in kinds behind one interface (engine/sessions/backend.py `SessionBackend`): memory sessions
on the device, and Larimar sessions kept in the memory service (engine/sessions/larimar.py).
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

from engine.caches.kv_prefix import KVPrefixCache, PromptReuse
from engine.caches.store import StoreBridge, model_fingerprint
from engine.config import EngineConfig
from engine.protocol import (
    CollectionAttachment,
    EngineHealth,
    EngineStats,
    GenerationDelta,
    IngestProgress,
    InvalidRequest,
    MemorySpec,
    ModelInfo,
    PreparedPrompt,
    Prompt,
    SamplingParams,
    SessionMemoryInfo,
    SessionTurn,
    Tokenized,
    TokenizerInfo,
    TokenPrompt,
)
from engine.runner.adapter import AnswerAdapter, load_adapters
from engine.runner.chat_template import assistant_turn_end, end_token_ids
from engine.runner.decode_state import KVCacheState
from engine.runner.decode_step import decoder_of
from engine.runner.generate import Generation, running_generation, step_batch
from engine.runner.grammar import Grammars
from engine.runner.loader import LoadedModel, load_model
from engine.runner.sampling import check_sampling
from engine.runner.tool_template import tool_format
from engine.scheduler.heap import trim_heap
from engine.scheduler.preprocess import Preprocessor, lower_thread_priority
from engine.scheduler.prompts import PromptReader
from engine.scheduler.stream import aborted_delta, submit
from engine.scheduler.worker import Worker
from engine.sessions.backend import Decoding, SessionBackend
from engine.sessions.conversation import check_memory_cap
from engine.sessions.frame_backend import FrameBackend
from engine.sessions.larimar import LarimarBackend
from engine.stats import engine_stats
from memory_store.client import MemoryStoreClient


class LocalEngine:
    """The in-process engine: a loaded model, one device thread, and the sessions' memories.

    `store`: the process's memory store client, shared with the server; the engine uses it
    from its own loop thread (StoreBridge) and from the caller's loop (Larimar), so it must be
    an in-process client. None: the engine builds its own from config (memory_store_url or
    data_dir), or keeps no store.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        loaded: LoadedModel | None = None,
        store: MemoryStoreClient | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.loaded = loaded or load_model(self.config)
        self._tokenizer = self.loaded.tokenizer  # the grammars' (llguidance's) only
        self._device_tokenizer = copy.deepcopy(self.loaded.tokenizer)  # device thread
        self._prompts = PromptReader(self.loaded.tokenizer)  # a copy per thread
        self._preprocessor = Preprocessor(
            self.config.preprocess_threads,
            self.config.preprocess_threads_per_tenant,
            self.config.max_preprocess_waiting_per_tenant,
            on_start=self._start_preprocessing,
        )
        # structured outputs: compiled on the caller's thread, enforced on the device thread
        self._grammars = Grammars(self._tokenizer, self._tokenizer.eos_token_id)
        self._decoding = Decoding(
            self._device_tokenizer,
            end_token_ids(self._tokenizer, self.loaded.model),
            self.config.prefill_chunk_tokens,
            len(self._tokenizer),
            assistant_turn_end(self._tokenizer),  # closes an answer in a session
            self._grammars,
        )
        # The memory service (engine/caches/store.py): None unless `store`, memory_store_url or
        # data_dir is given.
        self._store = StoreBridge.from_config(self.config, store)
        self._model_fingerprint = (
            model_fingerprint(self.loaded.model_id, self.loaded.model) if self._store else ""
        )
        # Rows per decode forward (0: all of them in one). Under the int4 kernels a step past
        # 8 rows always runs as forwards of 8: rows never mix, and at 16 clients it decoded
        # 1.44x faster than one GEMM forward (docs/decisions/055); batch_invariant also cuts
        # float linears' steps to single rows.
        decoder = decoder_of(self.loaded.model)
        rows = decoder.invariant_rows if decoder is not None else 1
        self._invariant_rows = rows if self.config.batch_invariant or rows > 1 else 0
        offload_after = self.config.session_offload_after_s
        spills = self.config.memory_ram_bytes > 0 and self.config.memory_disk_bytes > 0
        self._worker = Worker(
            self.config.max_waiting_requests,
            self.config.max_running_requests,
            run_batch=self._step_batch,
            can_batch=_can_batch,
            housekeeping=self._offload_idle_sessions if offload_after > 0 or spills else None,
            housekeeping_interval_s=min(max(offload_after / 4, 0.01), 10.0)
            if offload_after
            else 10.0,
            on_idle=trim_heap if self.config.trim_heap else None,
            decode_share=self.config.decode_share,
            max_waiting_per_tenant=self.config.waiting_per_tenant,
            max_running_per_tenant=self.config.running_per_tenant,
        )
        self._frame_backend = FrameBackend(
            self.loaded.model,
            self.config,
            self._worker,
            self._decoding,
            self._prompts.encode,
            self._store,
            self._model_fingerprint,
            self.loaded.kv_dtype,
        )
        # plain prompts' kept keys and values, a block per prefill chunk
        self._kv_prefixes = KVPrefixCache(
            self.config.kv_prefix_cache_bytes, self.config.prefill_chunk_tokens
        )
        self._larimar_backend = LarimarBackend(self, self._prompts.count, self.config, store)
        self._backends: tuple[SessionBackend, ...] = (self._frame_backend, self._larimar_backend)
        # answer adapters, by model id (engine/runner/adapter.py)
        self._adapters = load_adapters(
            self.loaded.model, self.loaded.model_id, self.config.adapters
        )
        self._info = ModelInfo(
            id=self.loaded.model_id,
            adapters=tuple(self._adapters),
            max_model_len=self.loaded.max_model_len,
            strategies=self._frame_backend.strategies + self._larimar_backend.strategies,
            created=int(time.time()),
            tool_format=tool_format(self._tokenizer),
        )

    # -- tokenization (the preprocessing threads) ---------------------------------------------

    def _start_preprocessing(self) -> None:
        """A preprocessing thread's start: its niceness, its tokenizer copied up front (not
        in a request's time)."""
        lower_thread_priority(self.config.preprocess_nice)
        self._prompts.tokenizer()

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids (chat messages through the chat template); blocking."""
        return self._prompts.encode_prompt(prompt)

    # -- sessions, whatever their kind ----------------------------------------------------------

    def _backend_of(self, session_id: str) -> SessionBackend:
        """The kind holding the session; memory sessions answer for an unknown id."""
        return next((k for k in self._backends if session_id in k), self._frame_backend)

    def _backend_for(self, spec: MemorySpec) -> SessionBackend:
        """The kind serving the strategy; memory sessions refuse an unknown one."""
        return next(
            (k for k in self._backends if spec.strategy in k.strategies), self._frame_backend
        )

    # -- EngineClient -------------------------------------------------------------------------

    @property
    def model(self) -> ModelInfo:
        return self._info

    async def prepare(
        self,
        prompt: Prompt | TokenPrompt,
        sampling: SamplingParams,
        *,
        tenant: str | None = None,
        token_limit: int | None = None,
    ) -> PreparedPrompt:
        self._worker.check_alive()
        check_sampling(sampling)

        def prepare() -> PreparedPrompt:
            if sampling.response_format is not None:
                self._grammars.compile(sampling.response_format)  # InvalidRequest if it cannot
            return self._prompts.prepare(prompt, token_limit)

        return await self._preprocessor.run(tenant, prepare)

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
        self._worker.check_alive()
        check_sampling(sampling)
        answers = self._adapter(adapter)
        prepared: torch.Tensor | None = None
        if isinstance(prompt, PreparedPrompt):  # tokenized, its grammar compiled
            prepared = prompt.token_ids
            prompt = prompt.prompt
        elif sampling.response_format is not None:
            self._grammars.compile(sampling.response_format)  # InvalidRequest if it cannot
        if session_id is not None:
            backend = self._backend_of(session_id)
            return backend.generate(
                request_id,
                session_id,
                prompt,
                sampling,
                memory_room,
                prompt_ids=prepared,
                adapter=answers,
            )
        prompt_ids = prepared if prepared is not None else self._prompts.encode(prompt)  # (T,)
        total = len(prompt_ids) + sampling.max_tokens
        queued_at = time.perf_counter()
        if total <= self.loaded.max_model_len:
            steps = self._kv_steps(prompt_ids, sampling, queued_at, tenant, answers)
            on_abort = aborted_delta(len(prompt_ids))
            return submit(self._worker, request_id, steps, None, on_abort, tenant=tenant)
        check_memory_cap(total, self.config.max_memory_tokens)
        spec = memory or MemorySpec(strategy=self.config.memory_strategy)
        return self._backend_for(spec).generate_ephemeral(
            request_id, prompt, prompt_ids, sampling, spec, queued_at, scope=tenant, adapter=answers
        )

    def _adapter(self, name: str | None) -> AnswerAdapter | None:
        if name is None or name == self.loaded.model_id:
            return None
        if name not in self._adapters:
            raise InvalidRequest(f"no adapter model {name!r} is served", param="model")
        return self._adapters[name]

    async def count_tokens(self, prompt: Prompt) -> int:
        return await self._preprocessor.run(None, lambda: self._prompts.count(prompt))

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
        def tokenize() -> Tokenized:
            return self._prompts.tokenize(
                prompt, add_special_tokens, generation_prompt, token_strings, token_limit
            )

        return await self._preprocessor.run(tenant, tokenize)

    async def detokenize(self, token_ids: Sequence[int], *, tenant: str | None = None) -> str:
        def detokenize() -> str:
            return self._prompts.detokenize(token_ids)

        return await self._preprocessor.run(tenant, detokenize)

    @property
    def tokenizer_info(self) -> TokenizerInfo:
        tokenizer = self._tokenizer
        return TokenizerInfo(
            tokenizer_class=type(tokenizer).__name__,
            vocab_size=len(tokenizer),
            model_max_length=self.loaded.max_model_len,
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
            pad_token=tokenizer.pad_token,
            chat_template=tokenizer.chat_template
            if isinstance(tokenizer.chat_template, str)
            else None,
        )

    async def abort(self, request_id: str) -> None:
        self._worker.abort(request_id)

    async def create_session(self, session_id: str, memory: MemorySpec | None = None) -> None:
        spec = memory or MemorySpec(strategy=self.config.memory_strategy)
        if any(session_id in kind for kind in self._backends):
            raise InvalidRequest(f"session {session_id!r} already exists", param="session_id")
        await self._backend_for(spec).create(session_id, spec)

    async def import_turn(self, session_id: str, turn: SessionTurn) -> None:
        await self._backend_of(session_id).import_turn(session_id, turn)

    async def drop_session(self, session_id: str) -> None:
        await self._backend_of(session_id).drop(session_id)

    def ingest(self, request_id: str, session_id: str, text: str) -> AsyncIterator[IngestProgress]:
        self._worker.check_alive()
        return self._backend_of(session_id).ingest(request_id, session_id, text)

    async def attach_collection(self, session_id: str, name: str) -> CollectionAttachment:
        """Attach `name` (written by `longserve ingest`) to the session (engine/sessions/document_collections.py)."""
        self._worker.check_alive()
        return await self._backend_of(session_id).attach_collection(session_id, name)

    def session_memory_info(self, session_id: str) -> SessionMemoryInfo | None:
        return self._frame_backend.memory_info(session_id)

    async def health(self) -> EngineHealth:
        if self._worker.dead is not None:
            return EngineHealth(ok=False, detail=f"engine worker died: {self._worker.dead!r}")
        if not self._worker.is_alive():
            return EngineHealth(ok=False, detail="engine is shut down")
        return EngineHealth(ok=True, detail=f"{self._info.id} on {self.loaded.device}")

    def stats(self) -> EngineStats:
        return engine_stats(self._worker, self._frame_backend, self._kv_prefixes, self._grammars)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self._worker.stop)
        self._frame_backend.conversations.clear()
        if self._store is not None:
            await asyncio.to_thread(self._store.close)

    # -- the device thread ----------------------------------------------------------------------

    def _kv_steps(
        self,
        prompt_ids: torch.Tensor,
        sampling: SamplingParams,
        queued_at: float,
        tenant: str | None,
        adapter: AnswerAdapter | None = None,
    ) -> Generation:
        # Nothing runs until the worker steps it; its decode steps join the worker's batches.
        state = KVCacheState(
            self.loaded.model,
            max_tokens=len(prompt_ids) + sampling.max_tokens,
            kv_dtype=self.loaded.kv_dtype,
        )
        return Generation(
            state,
            prompt_ids,
            sampling,
            self._device_tokenizer,
            queued_at=queued_at,
            reuse=PromptReuse(self._kv_prefixes, tenant, state.cache),
            adapter=adapter,
            **self._decoding.kwargs(),
        )

    def _step_batch(self, steps: list[Any]) -> list[GenerationDelta | None | Exception]:
        return step_batch(self.loaded.model, steps, self._invariant_rows)

    def _offload_idle_sessions(self) -> None:
        self._frame_backend.offload_idle()


def _can_batch(steps: Any) -> bool:
    """Whether a job's steps are at a decode step of a Generation (any path)."""
    generation = running_generation(steps)
    return generation is not None and generation.batch_ready
