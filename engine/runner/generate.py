"""The small generation core: one request step by step, batched decode steps.

A `DecodeState` (decode_state.py) turns tokens into next-token logits. A `Generation` is one
request as an iterator: each `next()` does one unit of device work (one prefill chunk, or one
decode token) and returns a `GenerationDelta` or None, so the worker can interleave requests
between steps. `step_batch` runs the next decode token of many KV-path generations in one
forward: a decode forward costs about as much for 16 rows as for one (it is dominated by reading
the weights), so batching raises throughput with concurrency. That holds for every path: a
memory-path row attends to its own frame inside the same forward (engine/runner/rows.py).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import Any, Protocol

import torch

from engine.protocol import (
    AlternativeLogprob,
    FinishReason,
    GenerationDelta,
    RequestStats,
    SamplingParams,
    TokenLogprob,
)
from engine.runner.adapter import AnswerAdapter
from engine.runner.decode_state import DecodeState, decode_batch, prefill_chunks
from engine.runner.detokenize import Detokenizer, token_bytes, token_text
from engine.runner.grammar import Constraint, Grammars
from engine.runner.sampling import make_generator, sample_token, token_logprobs


def _logprob_entry(tokenizer: Any, logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    chosen, top = token_logprobs(logits, token_id, top_n)
    return TokenLogprob(
        token=token_text(tokenizer, token_id),
        logprob=chosen,
        bytes=list(token_bytes(tokenizer, token_id)),
        top_logprobs=[
            AlternativeLogprob(token_text(tokenizer, t), lp, list(token_bytes(tokenizer, t)))
            for t, lp in top
        ],
    )


class PrefixReuse(Protocol):
    """Where a request's prefill may start (engine/caches/kv_prefix.py's PromptReuse)."""

    def start(self, token_ids: torch.Tensor) -> int: ...

    def keep(self, token_ids: torch.Tensor) -> None: ...


class Generation:
    """One request, step by step: prefill the prompt (T,) in chunks, then decode until a stop
    string, an end token, or max_tokens.

    An iterator: each `next()` does one unit of device work on its own (a prefill chunk, or one
    decode token) and returns None when that step produced nothing to send, else a
    GenerationDelta; the last one carries finish_reason and stats. A delta is sent when its text
    is non-empty, when logprobs were asked for, or at the end; token ids of quiet steps ride on
    the next delta. With `after` (sessions), once the final delta is out the last generated
    token and then the `after` tokens (the chat template's end of turn; its first is skipped
    when the answer ended with it) are fed to the state one per step, so the session's context
    holds the whole turn; those steps batch like decode steps (`unread_tail` is what is left
    when a request stops early).

    Decode steps can also run batched, whatever the state's path: while `batch_ready`, the
    worker feeds `next_token` to `state` together with other requests' in one forward
    (`load_batch`), which leaves this request's logits for its next step; that step samples
    them (`accept`) with the request's own generator, penalties and stop strings. `text` and
    `output_ids` hold everything generated so far.

    prefilled: the state holds the prompt's first `prefilled` tokens already (a reused prefix,
    reported as cached_tokens); prefill reads the rest. prefill_cuts: prompt positions no
    prefill chunk straddles (a document's end, so the question after it is read whole).
    """

    def __init__(
        self,
        state: DecodeState,
        prompt_ids: torch.Tensor,
        sampling: SamplingParams,
        tokenizer: Any,
        *,
        stop_token_ids: Sequence[int] = (),
        prefill_chunk_tokens: int = 512,
        vocab_size: int | None = None,
        queued_at: float | None = None,
        after: Sequence[int] | None = None,
        prefilled: int = 0,
        prefill_cuts: Sequence[int] = (),
        grammars: Grammars | None = None,
        hold_final: bool = False,
        reuse: PrefixReuse | None = None,
        adapter: AnswerAdapter | None = None,
    ) -> None:
        self.state = state
        # the prompt's last adapter.lead tokens and every later one take the adapter's steps
        self.adapter = adapter
        # hold_final: the finishing delta (finish_reason, stats) is the iteration's return
        # value, once every step is done, so a session can close its turn before it goes out
        self._hold_final = hold_final
        self._final: GenerationDelta | None = None
        self.sampling = sampling
        self._tokenizer = tokenizer
        self._prompt_ids = prompt_ids
        self._prompt_tokens = int(prompt_ids.shape[0])
        self._prefilled = prefilled  # the prompt's first tokens, already in state (a reused prefix)
        self._cuts = [c - prefilled for c in prefill_cuts if c > prefilled]
        self._reuse = reuse
        # the prompt's last tokens read with the adapter; a reused prefix covers only the rest
        self._lead = 0 if adapter is None else min(adapter.lead, self._prompt_tokens - 1)
        self._reuse_ids = prompt_ids[: self._prompt_tokens - self._lead]
        self._chunk_tokens = prefill_chunk_tokens
        self._stop_ids = frozenset() if sampling.ignore_eos else frozenset(stop_token_ids)
        self._vocab_size = vocab_size
        self._queued_at = queued_at
        self._after = None if after is None else list(after)
        self._feed: list[int] = []  # after the final delta: tokens still to feed to the state
        self._prefill: Generator[torch.Tensor | None, None, None] | None = (
            None  # started by the first step
        )
        self._started = 0.0
        self._queue_seconds = 0.0
        self._prefill_seconds = 0.0
        self._detok: Detokenizer | None = None
        self._counts: torch.Tensor | None = None  # (vocab,) generated token counts, for penalties
        self._generator: torch.Generator | None = None
        self._constraint: Constraint | None = None  # response_format's grammar state
        self._grammars = grammars
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[TokenLogprob] = []
        self._loaded: torch.Tensor | None = None  # logits of a batched forward (load_batch)
        self.completion_tokens = 0
        self.output_ids: list[int] = []
        self._text: list[str] = []
        self.next_token: int | None = None  # sampled, not yet fed to the state
        self.finished = False  # the final delta was produced
        self.done = False  # nothing left to do (the tokens `after` are fed too, with sessions)

    @property
    def batch_ready(self) -> bool:
        """The next step feeds one token (`batch_token`) and may join a batch: a decode token,
        or one of the tokens fed after the end."""
        if self._loaded is not None or self.done:
            return False
        return bool(self._feed) if self.finished else self.next_token is not None

    @property
    def batch_token(self) -> int:
        """The token the next (batch_ready) step feeds to the state."""
        token = self._feed[0] if self.finished else self.next_token
        assert token is not None
        return token

    def unread_tail(self) -> list[int]:
        """What the state has not read of what it should hold at the end (with `after`): the
        tokens still to feed; for a request stopped before its end, its last sampled token and
        the `after` tokens."""
        if self._after is None:
            return []
        if self.finished:
            return [] if self.done else list(self._feed)
        return self._tail([self.next_token] if self.next_token is not None else [])

    def _tail(self, sampled: list[int]) -> list[int]:
        after = self._after or []
        return sampled + (after[1:] if sampled and after and sampled[-1] == after[0] else after)

    @property
    def text(self) -> str:
        """The text generated so far."""
        return "".join(self._text)

    def load(self, logits: torch.Tensor) -> None:
        """The logits (vocab,) a batched forward computed for batch_token: the next step
        samples them instead of running its own forward (after the end, it only moves on)."""
        assert self.batch_ready
        self._loaded = logits

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> GenerationDelta | None:
        if self.done:
            raise StopIteration(self._final)
        if self.finished:  # `after`: the answer's last token and the end of turn join the context
            token = self._feed.pop(0)
            logits, self._loaded = self._loaded, None
            if logits is None:  # else a batched forward read it already
                with torch.inference_mode():
                    self._step(token)
            if self._feed:
                return None
            self.done = True
            raise StopIteration(self._final)
        if self.next_token is None:
            return self._prefill_step()
        logits, self._loaded = self._loaded, None
        if logits is None:
            with torch.inference_mode():
                logits = self._step(self.next_token)
        return self.accept(logits)

    def _step(self, token: int) -> torch.Tensor:
        if self.adapter is None:
            return self.state.step(token)
        return self.adapter.step(self.state, token)

    def close(self) -> None:
        """Stop here: every later step ends the iteration."""
        self.done = True
        if self._prefill is not None:
            self._prefill.close()

    def _prefill_step(self) -> GenerationDelta | None:
        if self._prefill is None:
            self._started = time.perf_counter()
            if self._queued_at is not None:
                self._queue_seconds = max(0.0, self._started - self._queued_at)
            self.state.pop_retrieval_seconds()  # time spent before this request is not ours
            self._detok = Detokenizer(self._tokenizer, self.sampling.stop)
            if self._reuse is not None:
                reused = self._reuse.start(self._reuse_ids)
                self._cuts = [c - reused for c in self._cuts if c > reused]
                self._prefilled += reused
            rest = self._prompt_ids[self._prefilled :]
            self._prefill = self._read_prompt(rest)
        logits = next(self._prefill)
        if logits is None:
            return None
        # the prompt is read: close the reader, whose suspended frame would otherwise hold
        # this Generation (and its state) in a reference cycle (docs/decisions/084)
        self._prefill.close()
        if self._reuse is not None:
            self._reuse.keep(self._reuse_ids)
        self._prefill_seconds = time.perf_counter() - self._started
        return self.accept(logits)

    def _read_prompt(self, rest: torch.Tensor) -> Generator[torch.Tensor | None, None, None]:
        """prefill_chunks over the prompt's unread rest; with an adapter, its last `lead`
        tokens (at most all but one) are decode steps of the adapter instead."""
        lead = min(self._lead, int(rest.shape[0]) - 1)
        if lead <= 0:
            yield from prefill_chunks(self.state, rest, self._chunk_tokens, self._cuts)
            return
        for logits in prefill_chunks(self.state, rest[:-lead], self._chunk_tokens, self._cuts):
            if logits is None:
                yield None
        with torch.inference_mode():
            for token in rest[-lead:].tolist():
                logits = self._step(token)
        yield logits

    def accept(self, logits: torch.Tensor) -> GenerationDelta | None:
        """Sample the next token from logits (vocab,); the delta to send, or None."""
        sampling, detok = self.sampling, self._detok
        assert detok is not None and not self.finished
        with torch.inference_mode():
            if self._vocab_size is not None and logits.shape[-1] > self._vocab_size:
                logits = logits[: self._vocab_size]  # padded embedding rows are never sampled
            if self._counts is None:
                self._counts = torch.zeros(
                    logits.shape[-1], dtype=torch.int32, device=logits.device
                )
                if sampling.temperature != 0.0:
                    self._generator = make_generator(sampling.seed, logits.device)
                if sampling.response_format is not None:
                    assert self._grammars is not None, "response_format needs the engine's grammars"
                    self._constraint = self._grammars.constraint(sampling.response_format)
            allowed = logits if self._constraint is None else self._constraint.mask(logits)
            # an answer read afresh with copy_numbers (engine/sessions/frame_text.py)
            numbers = getattr(self.state, "number_copy", None)
            if numbers is not None:
                copied = numbers.mask(allowed)
                if copied is not allowed and bool(torch.isfinite(copied).any()):
                    allowed = copied  # else the grammar allows no digit it needs: grammar wins
            token_id = sample_token(allowed, sampling, self._counts, self._generator)
            if self._constraint is not None:
                self._constraint.advance(token_id)
            if numbers is not None:
                numbers.advance(token_id)
            if sampling.logprobs:
                self._pending_logprobs.append(
                    _logprob_entry(self._tokenizer, logits, token_id, sampling.top_logprobs)
                )
            if sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0:
                self._counts[token_id] += 1
        self.next_token = token_id
        self.completion_tokens += 1
        self._pending_ids.append(token_id)
        self.output_ids.append(token_id)

        finish: FinishReason | None = None
        if token_id in self._stop_ids:
            finish, text = "stop", detok.finish()
        else:
            text = detok.add(token_id)
            if detok.stopped:
                finish = "stop"
            elif self._constraint is not None and self._constraint.finished:
                finish, text = "stop", text + detok.finish()  # the JSON value closed
            elif self.completion_tokens == sampling.max_tokens:
                finish, text = "length", text + detok.finish()

        stats = None
        if finish is not None:
            self.finished = True
            self._feed = self._tail([token_id]) if self._after is not None else []
            self.done = not self._feed
            stats = RequestStats(
                queue_seconds=self._queue_seconds,
                prefill_seconds=self._prefill_seconds,
                retrieval_seconds=self.state.pop_retrieval_seconds(),
                strategy=self.state.strategy,
                memory_tokens=self.state.num_tokens if self.state.strategy is not None else 0,
            )
        self._text.append(text)
        if self._hold_final and finish is not None:  # the text now, the finish at the end
            self._final = self._delta("", [], None, finish, stats)
            finish, stats = None, None
        if finish is None and not text and not sampling.logprobs:
            return None
        logprobs = self._pending_logprobs if sampling.logprobs else None
        delta = self._delta(text, self._pending_ids, logprobs, finish, stats)
        self._pending_ids, self._pending_logprobs = [], []
        return delta

    def _delta(
        self,
        text: str,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None,
        finish: FinishReason | None,
        stats: RequestStats | None,
    ) -> GenerationDelta:
        return GenerationDelta(
            text=text,
            token_ids=token_ids,
            prompt_tokens=self._prompt_tokens,
            cached_tokens=self._prefilled,
            completion_tokens=self.completion_tokens,
            logprobs=logprobs,
            finish_reason=finish,
            stats=stats,
        )


def load_batch(model: Any, generations: Sequence[Generation]) -> None:
    """The forward of one decode step of every generation (each `batch_ready`, on any path):
    each one's next step samples the logits it left (Generation.load). Raises when the forward
    fails; then no state has changed, and the requests can run their step one by one."""
    assert all(g.batch_ready for g in generations), "a generation is not at a decode step"
    tokens = [g.batch_token for g in generations]
    states, adapters = [g.state for g in generations], [g.adapter for g in generations]
    logits = decode_batch(model, states, tokens, adapters)  # (B, vocab)
    for row, generation in enumerate(generations):
        generation.load(logits[row])


def step_batch(
    model: Any, steps: Sequence[Any], max_rows: int = 0
) -> list[GenerationDelta | None | Exception]:
    """One decode step of several requests in one forward (or in forwards of at most
    `max_rows` rows, when > 0: batch-invariant decoding, EngineConfig.batch_invariant):
    `load_batch` over the Generation each request's steps are at (`running_generation`), then
    each one's own next step. Each request's output (a delta or None), or the exception its
    own step raised."""
    ready = [g for g in (running_generation(s) for s in steps) if g is not None]
    size = max_rows or max(len(ready), 1)
    for start in range(0, len(ready), size):
        load_batch(model, ready[start : start + size])
    results: list[GenerationDelta | None | Exception] = []
    for request in steps:
        try:
            results.append(next(request))
        except Exception as e:  # StopIteration included: the worker ends the job
            results.append(e)
    return results


def running_generation(steps: Any) -> Generation | None:
    """The Generation a job's steps are at: the steps themselves, or the one a generator
    delegates to (`yield from`, through nested generators)."""
    while steps is not None and not isinstance(steps, Generation):
        steps = getattr(steps, "gi_yieldfrom", None)
    return steps
