"""The n choices of a request: fanned out into engine requests, run at once, their deltas
merged in arrival order, with the latency metrics and the usage they add up to.

Every engine iterator is closed on every path out (finished, failed, client gone), which is
how the engine learns to abort a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request

from engine.protocol import (
    EngineError,
    GenerationDelta,
    MemorySpec,
    PreparedPrompt,
    Prompt,
    SamplingParams,
    TokenLogprob,
    TokenPrompt,
)
from server.auth import tenant_session_id
from server.disconnect import until_disconnected
from server.protocol import MemoryRequest, PromptTokensDetails, UsageInfo
from server.serving.checks import check_prompt_tokens, counted_within
from server.serving.context import ServingContext
from server.sessions.models import Session

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChoiceRequest:
    """One engine request: one choice of one prompt."""

    index: int  # the choice index in the response
    prompt_index: int
    request_id: str
    # prepared by `prepare_jobs`, once for all its choices (token ids only ever so)
    prompt: Prompt | TokenPrompt | PreparedPrompt
    sampling: SamplingParams
    adapter: str | None = None  # an answer adapter's model id (checks.adapter_of)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_memory(
    tenant: str, session_id: str | None, memory: MemoryRequest | None
) -> tuple[str | None, MemorySpec | None]:
    session = tenant_session_id(tenant, session_id) if session_id else None
    spec = MemorySpec(strategy=memory.strategy, params=memory.knobs()) if memory else None
    return session, spec


def fan_out(
    base_id: str,
    prompts: Sequence[Prompt | TokenPrompt],
    n: int,
    sampling: SamplingParams,
    adapter: str | None = None,
) -> list[ChoiceRequest]:
    """n choices per prompt; choice i of prompt p has index p*n+i and seed seed+i."""
    jobs = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            index = p * n + i
            seed = None if sampling.seed is None else sampling.seed + i
            request_id = f"{base_id}-{index}"
            seeded = _with_seed(sampling, seed)
            jobs.append(ChoiceRequest(index, p, request_id, prompt, seeded, adapter))
    return jobs


def _with_seed(sampling: SamplingParams, seed: int | None) -> SamplingParams:
    return replace(sampling, seed=seed)


async def prepare_jobs(
    ctx: ServingContext,
    raw_request: Request,
    tenant: str,
    jobs: list[ChoiceRequest],
    params: Sequence[str],
) -> list[ChoiceRequest]:
    """The jobs with their prompts prepared by the engine (tokenized, chat template applied,
    grammar compiled, off the event loop), once per prompt for all its choices; a prompt past
    max_prompt_tokens is refused naming params[its index]. A client that goes away meanwhile
    gets a 499 and leaves no preparation waiting."""
    prepared: dict[int, PreparedPrompt] = {}
    for job in jobs:
        if job.prompt_index in prepared or isinstance(job.prompt, PreparedPrompt):
            continue
        with counted_within(ctx.settings, params[job.prompt_index]) as limit:
            ready = await until_disconnected(
                raw_request,
                ctx.engine.prepare(job.prompt, job.sampling, tenant=tenant, token_limit=limit),
            )
        check_prompt_tokens(ctx.settings, ready.num_tokens, params[job.prompt_index])
        prepared[job.prompt_index] = ready
    return [replace(job, prompt=prepared.get(job.prompt_index, job.prompt)) for job in jobs]


# ---------------------------------------------------------------------------------------------
# Running the jobs: one pump task per engine iterator, merged through a queue.
# ---------------------------------------------------------------------------------------------

_END = object()


@dataclass
class _ChoiceClock:
    """Per-choice timing for the latency metrics."""

    started: float
    last: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    finished: bool = False


@dataclass
class ChoiceStreams:
    """n engine generations running at once; iterate to get (choice index, delta) in arrival
    order. Always `await aclose()` (it aborts whatever is still running)."""

    ctx: ServingContext
    jobs: list[ChoiceRequest]
    session_id: str | None
    memory: MemorySpec | None
    tenant: str | None = None
    session: Session | None = None  # the registry's session the request is on
    started_at: float = 0.0  # wall clock: orders the session's turns among its documents
    _queue: asyncio.Queue[tuple[int, Any]] = field(default_factory=asyncio.Queue)
    _buffer: deque[tuple[int, Any]] = field(default_factory=deque)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _open: int = 0

    @classmethod
    async def start(
        cls,
        ctx: ServingContext,
        jobs: list[ChoiceRequest],
        session_id: str | None,
        memory: MemorySpec | None,
        tenant: str | None = None,
        session: Session | None = None,
    ) -> ChoiceStreams:
        """`session`: the registry's session the request is on (None without one, or when no
        store tells the server of it); its turns are counted, stored and budgeted."""
        streams = cls(ctx, jobs, session_id, memory, tenant, session, ctx.sessions.clock())
        started = time.perf_counter()
        room = await ctx.sessions.memory_room(session.tenant) if session is not None else None
        iterators: list[AsyncIterator[GenerationDelta]] = []
        try:
            for job in jobs:
                if isinstance(job.prompt, TokenPrompt):  # prepare_jobs reads them
                    raise TypeError("token-id prompts are prepared before they run")
                iterators.append(
                    ctx.engine.generate(
                        job.request_id,
                        job.prompt,
                        job.sampling,
                        session_id=session_id,
                        memory=memory,
                        tenant=tenant,
                        memory_room=room,
                        adapter=job.adapter,
                    )
                )
        except BaseException:
            for iterator in iterators:
                await _aclose(iterator)
            raise
        for job, iterator in zip(jobs, iterators, strict=True):
            task = asyncio.create_task(streams._pump(job.index, iterator, started))
            streams._tasks.append(task)
        streams._open = len(jobs)
        return streams

    async def _pump(
        self, index: int, iterator: AsyncIterator[GenerationDelta], started: float
    ) -> None:
        clock = _ChoiceClock(started=started)
        reason = "abort"
        try:
            async for delta in iterator:
                self._observe(clock, delta)
                if delta.finish_reason == "error":
                    reason = "error"
                    raise EngineError("the engine failed while generating")
                if delta.turns and self.session is not None:  # stored before the last byte
                    await self.ctx.sessions.record_turns(self.session, delta.turns, self.started_at)
                self._queue.put_nowait((index, delta))
                if delta.finish_reason is not None:
                    reason = delta.finish_reason
                    break
            self._queue.put_nowait((index, _END))
        except Exception as exc:
            reason = "error"
            self._queue.put_nowait((index, exc))
        finally:
            await _aclose(iterator)
            if not clock.finished:  # aborted or failed: still one finished engine request
                self._finish_metrics(clock, reason, None)

    def _observe(self, clock: _ChoiceClock, delta: GenerationDelta) -> None:
        now = time.perf_counter()
        new_tokens = delta.completion_tokens - clock.tokens
        clock.prompt_tokens = delta.prompt_tokens
        if new_tokens > 0:
            if clock.last is None:
                self.ctx.metrics.first_token(now - clock.started)
                if new_tokens > 1:
                    self.ctx.metrics.inter_token(0.0, new_tokens - 1)
            else:
                self.ctx.metrics.inter_token(now - clock.last, new_tokens)
            clock.last = now
            clock.tokens = delta.completion_tokens
        if delta.finish_reason is not None and delta.finish_reason != "error":
            self._finish_metrics(clock, delta.finish_reason, delta)

    def _finish_metrics(
        self, clock: _ChoiceClock, reason: str, delta: GenerationDelta | None
    ) -> None:
        clock.finished = True
        self.ctx.metrics.request_finished(
            finish_reason=reason,
            e2e_seconds=time.perf_counter() - clock.started,
            prompt_tokens=clock.prompt_tokens,
            generation_tokens=clock.tokens,
            stats=delta.stats if delta else None,
        )

    async def prime(self, timeout: float) -> None:
        """Wait up to `timeout` for every choice's first event; raise the first error."""
        deadline = time.perf_counter() + timeout
        seen: set[int] = set()
        while len(seen) < len(self.jobs):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            try:
                item = await asyncio.wait_for(self._queue.get(), remaining)
            except TimeoutError:
                return
            self._buffer.append(item)
            seen.add(item[0])
            if isinstance(item[1], BaseException):
                raise item[1]

    def __aiter__(self) -> AsyncIterator[tuple[int, GenerationDelta]]:
        return self._events()

    async def _events(self) -> AsyncIterator[tuple[int, GenerationDelta]]:
        while self._open > 0:
            index, item = self._buffer.popleft() if self._buffer else await self._queue.get()
            if item is _END:
                self._open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    def interrupt(self, error: Exception) -> None:
        """End the iteration with `error` (raised by the iterator), whatever is still running."""
        self._queue.put_nowait((-1, error))
        self._buffer.clear()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def _aclose(iterator: AsyncIterator[Any]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        logger.exception("closing an engine iterator failed")


# ---------------------------------------------------------------------------------------------
# Usage accounting.
# ---------------------------------------------------------------------------------------------


@dataclass
class UsageCounter:
    """prompt tokens once per prompt (from the deltas), completion tokens summed over choices."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: dict[int, int] = field(default_factory=dict)

    def add(self, job: ChoiceRequest, delta: GenerationDelta) -> None:
        self.prompt_tokens[job.prompt_index] = delta.prompt_tokens
        self.cached_tokens[job.prompt_index] = delta.cached_tokens
        self.completion_tokens[job.index] = delta.completion_tokens

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(self.completion_tokens.values())
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(self.cached_tokens.values())
            ),
        )


# ---------------------------------------------------------------------------------------------
# Gathering whole choices (non-streaming responses).
# ---------------------------------------------------------------------------------------------


@dataclass
class GatheredChoice:
    """One choice's whole output, gathered from its deltas."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # None: no delta carried logprobs
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def gather_choices(streams: ChoiceStreams) -> tuple[dict[int, GatheredChoice], UsageInfo]:
    """Every choice's output, by choice index, and the usage they add up to."""
    jobs = {job.index: job for job in streams.jobs}
    choices = {i: GatheredChoice() for i in jobs}
    usage = UsageCounter()
    async for index, delta in streams:
        choice = choices[index]
        choice.texts.append(delta.text)
        if delta.logprobs is not None:
            if choice.logprobs is None:
                choice.logprobs = []
            choice.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
        usage.add(jobs[index], delta)
    return choices, usage.usage()
