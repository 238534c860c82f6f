"""The small generation core: a decode state, and a generator yielding one step at a time.

A `DecodeState` turns tokens into next-token logits. `KVCacheState` runs the model with its own
attention over a transformers DynamicCache (prompts that fit the window); `MemoryState` wraps a
session's `SessionMemory` (prompts longer than the window, and sessions). `generate_steps` is a
generator: each `next()` does one unit of device work (one prefill chunk, or one decode token)
and yields a `GenerationDelta` or None, so the worker can interleave requests between steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from engine.detokenize import Detokenizer, token_bytes, token_text
from engine.protocol import (
    FinishReason,
    GenerationDelta,
    RequestStats,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
)
from engine.sampling import make_generator, sample_token, token_logprobs


class DecodeState(Protocol):
    """Everything the model has read for one request; each call appends tokens to it."""

    strategy: str | None  # the memory strategy, None for the plain KV cache

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Append input_ids (T,) to the context; logits (vocab,) at the last position."""
        ...

    def step(self, token_id: int) -> torch.Tensor:
        """Append one token; logits (vocab,) for the next."""
        ...

    @property
    def num_tokens(self) -> int: ...

    def pop_retrieval_seconds(self) -> float: ...


class KVCacheState:
    """The model's own attention over a DynamicCache. The context must fit max_model_len."""

    strategy: str | None = None

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        self._model = model
        self._device = next(model.parameters()).device
        self._cache = DynamicCache(config=model.config)
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.to(self._device, dtype=torch.long).view(1, -1)  # (1, T)
        positions = torch.arange(
            self._num_tokens, self._num_tokens + ids.shape[1], device=self._device
        )  # (T,)
        out = self._model(
            input_ids=ids,
            past_key_values=self._cache,
            cache_position=positions,
            position_ids=positions.view(1, -1),
            use_cache=True,
            logits_to_keep=1,
        )
        self._num_tokens += ids.shape[1]
        return out.logits[0, -1]  # (vocab,)

    def step(self, token_id: int) -> torch.Tensor:
        return self.prefill(torch.tensor([token_id], dtype=torch.long))

    def pop_retrieval_seconds(self) -> float:
        return 0.0


class MemoryState:
    """A session's memory: every token appended (prompt and generated) joins its context."""

    def __init__(self, memory: Any, strategy: str | None) -> None:
        self.memory = memory  # engine.memory.session.SessionMemory
        self.strategy = strategy

    @property
    def num_tokens(self) -> int:
        return int(self.memory.num_tokens)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.memory.append(input_ids.to(torch.long).view(-1))  # (T,) -> (vocab,)

    def step(self, token_id: int) -> torch.Tensor:
        return self.prefill(torch.tensor([token_id], dtype=torch.long))

    def pop_retrieval_seconds(self) -> float:
        return float(self.memory.pop_retrieval_seconds())


def prefill_chunks(
    state: DecodeState, input_ids: torch.Tensor, chunk_tokens: int
) -> Iterator[torch.Tensor | None]:
    """Prefill input_ids (T,) in chunks: yields None after each chunk but the last, then the
    logits (vocab,) at the last position."""
    total = int(input_ids.shape[0])
    for start in range(0, total, chunk_tokens):
        logits = state.prefill(input_ids[start : start + chunk_tokens])
        if start + chunk_tokens < total:
            yield None
    yield logits


def _logprob_entry(tokenizer: Any, logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    chosen, top = token_logprobs(logits, token_id, top_n)
    return TokenLogprob(
        token=token_text(tokenizer, token_id),
        logprob=chosen,
        bytes=list(token_bytes(tokenizer, token_id)),
        top_logprobs=[
            TopLogprob(token_text(tokenizer, t), lp, list(token_bytes(tokenizer, t))) for t, lp in top
        ],
    )


def generate_steps(
    state: DecodeState,
    prompt_ids: torch.Tensor,
    sampling: SamplingParams,
    tokenizer: Any,
    *,
    stop_token_ids: Sequence[int] = (),
    prefill_chunk_tokens: int = 512,
    vocab_size: int | None = None,
    queued_at: float | None = None,
    append_final_token: bool = False,
) -> Iterator[GenerationDelta | None]:
    """Prefill the prompt (T,), then decode until a stop, EOS, or max_tokens.

    Yields None for a step that produced nothing to send, else a GenerationDelta; the last one
    carries finish_reason and stats. A delta is sent when its text is non-empty, when logprobs
    were asked for, or at the end; token ids of quiet steps ride on the next delta. With
    append_final_token (sessions), the last generated token is fed to the state after the final
    delta is yielded, so the session's context holds the whole answer.
    """
    started = time.perf_counter()
    queue_seconds = max(0.0, started - queued_at) if queued_at is not None else 0.0
    prompt_tokens = int(prompt_ids.shape[0])
    state.pop_retrieval_seconds()  # time spent before this request (e.g. ingestion) is not ours
    logits: torch.Tensor | None = None
    for logits in prefill_chunks(state, prompt_ids, prefill_chunk_tokens):
        if logits is None:
            yield None
    assert logits is not None
    prefill_seconds = time.perf_counter() - started

    vocab = vocab_size or int(logits.shape[-1])
    counts = torch.zeros(logits.shape[-1], dtype=torch.int32, device=logits.device)  # (vocab,)
    needs_counts = sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0
    generator = None if sampling.temperature == 0.0 else make_generator(sampling.seed, logits.device)
    detok = Detokenizer(tokenizer, sampling.stop)
    stop_ids = set() if sampling.ignore_eos else set(stop_token_ids)
    pending_ids: list[int] = []
    pending_logprobs: list[TokenLogprob] = []

    for completion_tokens in range(1, sampling.max_tokens + 1):
        with torch.inference_mode():
            if logits.shape[-1] > vocab:  # padded embedding rows are never sampled
                logits = logits[:vocab]
            token_id = sample_token(logits, sampling, counts, generator)
            if sampling.logprobs:
                pending_logprobs.append(
                    _logprob_entry(tokenizer, logits, token_id, sampling.top_logprobs)
                )
        pending_ids.append(token_id)
        if needs_counts:
            counts[token_id] += 1

        finish: FinishReason | None = None
        if token_id in stop_ids:
            finish, text = "stop", detok.finish()
        else:
            text = detok.add(token_id)
            if detok.stopped:
                finish = "stop"
            elif completion_tokens == sampling.max_tokens:
                finish, text = "length", text + detok.finish()

        if finish is not None:
            stats = RequestStats(
                queue_seconds=queue_seconds,
                prefill_seconds=prefill_seconds,
                retrieval_seconds=state.pop_retrieval_seconds(),
                strategy=state.strategy,
                memory_tokens=state.num_tokens if state.strategy is not None else 0,
            )
            yield GenerationDelta(
                text=text,
                token_ids=pending_ids,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                logprobs=pending_logprobs if sampling.logprobs else None,
                finish_reason=finish,
                stats=stats,
            )
            if append_final_token:
                with torch.inference_mode():
                    state.step(token_id)
            return

        if text or sampling.logprobs:
            yield GenerationDelta(
                text=text,
                token_ids=pending_ids,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                logprobs=pending_logprobs if sampling.logprobs else None,
            )
            pending_ids, pending_logprobs = [], []
        else:
            yield None
        with torch.inference_mode():
            logits = state.step(token_id)
