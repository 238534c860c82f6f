"""The `larimar` strategy: a session's document lives in the memory service's Larimar memory, and
a question is answered from a short prompt built out of what the memory reads back.

Following "Needle in the Haystack for Memory Based LLMs" (Nelson et al., 2024), section 2.1:
the document is cut into sentences, each written to the associative memory M under a one-hot
writing key (the nearest row of the key memory to the encoding of its first `prefix_length`
words); a query is read with the key of its own prefix, z = wM. Larimar then decodes z with a
decoder trained to read it. longserve has no such decoder: the readout only *identifies* the
slot(s), and the text of the sentences written there conditions the ordinary LLM decoder:

    [retrieved sentences, in document order] + "\n" + [the question]

which is short, so generation runs normally inside the model's window. The read is done with
the question's last sentence, e.g. "The pass key is" for a completion prompt ending in "What is
the pass key? The pass key is" (the paper feeds exactly that final partial sentence to the
decoder along with the readout), and the last sentence of the last user message for chat.

Knobs (`MemorySpec("larimar", {...})`):
  prefix_length  words of the fixed-length prefix behind the reading/writing keys (paper: 4).
                 It is a property of the stored memory: the memory service writes with its own
                 `LarimarConfig.prefix_length`, so a spec naming another value is refused by
                 `LarimarReader` (build the reader with `LarimarReader.in_process`, which builds
                 the store with the spec's value, or configure the service accordingly).
  top_k          slots read, nearest key first (paper: 1, the single nearest key row).
  use_prefix     read with the query's prefix (True, the paper's setting) or its whole text.
  max_segments   cap on distinct sentences put in the conditioned prompt (a slot can hold many
                 different sentences that share a prefix).
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.protocol import (
    CollectionAttachment,
    CollectionIncompatible,
    EngineClient,
    GenerationDelta,
    IngestProgress,
    InvalidRequest,
    MemorySpec,
    Prompt,
    SamplingParams,
    SessionTurn,
    StoreUnavailableError,
)
from engine.runner.adapter import AnswerAdapter
from engine.scheduler.fair import session_tenant
from engine.sessions.larimar_prompt import (
    conditioned,
    reading_query,
    retrieved_sentences,
    split_context,
)
from memory_store.client import (
    LarimarConfig,
    LarimarHit,
    MemoryStoreClient,
    TextEncoder,
    embedded_client,
    http_client,
    in_process_client,
)
from memory_store.errors import StoreError

if TYPE_CHECKING:
    import torch

    from memory_store.client import Backend, embedded_client, http_client, in_process_client

STRATEGY = "larimar"


@dataclass(frozen=True)
class LarimarParams:
    """The `larimar` strategy's knobs; see the module docstring."""

    prefix_length: int = 4
    top_k: int = 3
    use_prefix: bool = True
    max_segments: int = 16


def _no_adapter(adapter: object) -> None:
    if adapter is not None:
        raise InvalidRequest(
            "an adapter model cannot answer from a larimar memory; name the base model",
            param="model",
        )


def parse_larimar_spec(spec: MemorySpec | None) -> LarimarParams:
    """Validate `MemorySpec("larimar", params)`; InvalidRequest(param="memory.<knob>") if bad."""
    if spec is None:
        return LarimarParams()
    if spec.strategy != STRATEGY:
        raise InvalidRequest(
            f"expected memory strategy {STRATEGY!r}, got {spec.strategy!r}", param="memory.strategy"
        )
    fields = {f.name: f for f in dataclasses.fields(LarimarParams)}
    values: dict[str, Any] = {}
    for name, value in dict(spec.params or {}).items():
        param = f"memory.{name}"
        if name not in fields:
            raise InvalidRequest(
                f"unknown knob {name!r} for memory strategy 'larimar'", param=param
            )
        if isinstance(fields[name].default, bool):
            if not isinstance(value, bool):
                raise InvalidRequest(f"{param} must be a boolean", param=param)
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequest(f"{param} must be a positive integer", param=param)
        values[name] = value
    return LarimarParams(**values)


# ---------------------------------------------------------------------------------------------
# The reader.
# ---------------------------------------------------------------------------------------------


class LarimarReader:
    """Writes documents to a session's Larimar memory and conditions prompts on what it reads.

    Every call is a coroutine on the asyncio side; the memory service does its encoding in
    threads, so nothing here holds the engine's device.
    """

    def __init__(
        self, client: MemoryStoreClient, top_k: int = 3, params: LarimarParams | None = None
    ) -> None:
        self.client = client
        self.params = params or LarimarParams(top_k=top_k)

    @classmethod
    def in_process(
        cls,
        backend: Backend,
        params: LarimarParams | None = None,
        *,
        encoder: TextEncoder | Callable[[], TextEncoder] | None = None,
    ) -> LarimarReader:
        """A reader over an in-process memory store whose writing keys use `params`'s
        prefix_length."""
        params = params or LarimarParams()
        client = in_process_client(
            backend, encoder=encoder, larimar=LarimarConfig(prefix_length=params.prefix_length)
        )
        return cls(client, params=params)

    def _check_prefix_length(self) -> None:
        store = getattr(self.client, "larimar", None)  # only the in-process client exposes it
        config = getattr(store, "config", None)
        if config is not None and config.prefix_length != self.params.prefix_length:
            raise InvalidRequest(
                f"memory.prefix_length {self.params.prefix_length} differs from the memory "
                f"store's {config.prefix_length}",
                param="memory.prefix_length",
            )

    def with_spec(self, spec: MemorySpec | None) -> LarimarReader:
        """The same store read with a request's knobs."""
        reader = LarimarReader(self.client, params=parse_larimar_spec(spec))
        reader._check_prefix_length()
        return reader

    async def write(self, session_id: str, text: str) -> int:
        """Segment `text` into sentences, write them, and save: returns once the memory is
        durable in the backend. Returns the number of sentences written."""
        self._check_prefix_length()
        return await self.client.larimar_write(session_id, text=text, save=True)

    async def read(self, session_id: str, prompt: Prompt) -> list[LarimarHit]:
        return await self.client.larimar_read(
            session_id, reading_query(prompt), self.params.top_k, self.params.use_prefix
        )

    async def conditioned_prompt(self, session_id: str, prompt: Prompt) -> Prompt:
        """The prompt to generate from: the retrieved sentences, then `prompt` (a completion
        string or chat messages, returned in the same form)."""
        hits = await self.read(session_id, prompt)
        return conditioned(prompt, retrieved_sentences(hits, self.params.max_segments))


# ---------------------------------------------------------------------------------------------
# The session kind.
# ---------------------------------------------------------------------------------------------


class LarimarBackend:
    """The session kind whose memory is the memory service's Larimar memory: the readout's
    sentences condition a plain generation. Asyncio side only: nothing here holds the device."""

    strategies: tuple[str, ...] = (STRATEGY,)

    def __init__(
        self,
        engine: EngineClient,
        count_tokens: Callable[[str], int],
        config: EngineConfig,
        store: MemoryStoreClient | None = None,
    ) -> None:
        self._engine = engine  # generates from the conditioned prompt
        self._count_tokens = count_tokens  # blocking; run in a thread
        self._config = config
        self._store = store  # the process's client; None: built from config on first use
        self._specs: dict[str, MemorySpec] = {}
        self._reader: LarimarReader | None = None

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._specs

    async def create(self, session_id: str, spec: MemorySpec) -> None:
        parse_larimar_spec(spec)
        self._specs[session_id] = spec

    async def drop(self, session_id: str) -> None:
        # Its memory lives in the memory service, which the server cleans up.
        self._specs.pop(session_id, None)

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
        _no_adapter(adapter)
        # the conversation never joins a Larimar memory (only documents are written to it),
        # so a request takes none of the tenant's memory budget and leaves no turn to store
        spec = self._specs[session_id]
        return self._generate(request_id, prompt, sampling, session_id, spec, None)

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
        _no_adapter(adapter)
        return self._generate(request_id, prompt, sampling, None, spec, scope)

    def ingest(self, request_id: str, session_id: str, text: str) -> AsyncIterator[IngestProgress]:
        return self._ingest(session_id, text)

    async def import_turn(self, session_id: str, turn: SessionTurn) -> None:
        raise InvalidRequest("a larimar session holds no turns", param="turn")

    async def attach_collection(self, session_id: str, name: str) -> CollectionAttachment:
        raise CollectionIncompatible(
            "a larimar session keeps no encodings; collections "
            "attach to segments, tokens and neurocache sessions"
        )

    def _larimar(self) -> LarimarReader:
        if self._reader is None:
            if self._store is not None:
                self._reader = LarimarReader(self._store)
            elif self._config.memory_store_url is not None:
                client = http_client(
                    self._config.memory_store_url,
                    timeout_s=self._config.memory_store_timeout_s,
                    token=self._config.memory_store_token,
                )
                self._reader = LarimarReader(client)
            else:
                root = (
                    Path(self._config.data_dir)
                    if self._config.data_dir is not None
                    else Path(tempfile.mkdtemp(prefix="longserve-larimar-"))
                )
                self._reader = LarimarReader(embedded_client(root / "memory-store"))
        return self._reader

    async def _generate(
        self,
        request_id: str,
        prompt: Prompt,
        sampling: SamplingParams,
        session_id: str | None,
        spec: MemorySpec,
        tenant: str | None,
    ) -> AsyncIterator[GenerationDelta]:
        reader = self._larimar().with_spec(spec)
        if tenant is None:
            tenant = session_tenant(session_id)
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
        prepared = await self._engine.prepare(conditioned, sampling, tenant=tenant)  # off the loop
        async for delta in self._engine.generate(request_id, prepared, sampling, tenant=tenant):
            if delta.stats is not None:
                delta = dataclasses.replace(
                    delta,
                    stats=dataclasses.replace(
                        delta.stats, strategy="larimar", retrieval_seconds=retrieval
                    ),
                )
            yield delta

    async def _ingest(self, session_id: str, text: str) -> AsyncIterator[IngestProgress]:
        started = time.perf_counter()
        tokens = await asyncio.to_thread(self._count_tokens, text)
        yield IngestProgress(0, tokens, time.perf_counter() - started)
        try:
            await self._larimar().write(session_id, text)
        except StoreError as e:
            raise StoreUnavailableError(f"larimar write failed: {e}") from e
        yield IngestProgress(tokens, tokens, time.perf_counter() - started, done=True)
