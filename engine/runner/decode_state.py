"""Decode states: what the model has read for one request, and how tokens are appended to it.

A `DecodeState` turns tokens into next-token logits. `KVCacheState` runs the model with its own
attention over a per-request KV cache (prompts that fit the window); `MemoryState`
(engine/sessions/memory_state.py) wraps a session's `SessionMemory` (prompts longer than the
window, and sessions). `decode_batch` appends one token to each of several states in one
forward, whatever their paths; `prefill_chunks` reads a prompt in chunks.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, Protocol

import torch

from engine.runner.attention import forward_through, require_longserve_attention
from engine.runner.contrast import PairedRow
from engine.runner.decode_step import decode_rows, decoder_of
from engine.runner.kv_cache import KVBatch, KVCache
from engine.runner.rows import DecodeRow, KVRow


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

    def decode_row(self, token_id: int) -> DecodeRow | PairedRow:
        """Appending token_id as a row of a batched decode forward (engine/runner/rows.py), or
        two (a PairedRow: context-aware decoding, engine/runner/contrast.py)."""
        ...


class KVCacheState:
    """The model's own attention over a per-request `KVCache`. The context must fit the window.

    Decode steps of many KVCacheStates can share one forward (`decode_batch`).
    """

    strategy: str | None = None

    def __init__(self, model: Any, max_tokens: int | None = None, kv_dtype: str = "model") -> None:
        require_longserve_attention(model)
        self._model = model
        self._device = next(model.parameters()).device
        # "model" (or an unresolved "auto") keeps the model's dtype; LoadedModel.kv_dtype resolves
        dtype = None if kv_dtype in ("model", "auto") else getattr(torch, kv_dtype)
        self.cache = KVCache(model, max_tokens, dtype)

    @property
    def num_tokens(self) -> int:
        return self.cache.num_tokens

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.to(self._device, dtype=torch.long).view(1, -1)  # (1, T)
        return forward_kv(self._model, [self], ids)[0]  # (vocab,)

    def step(self, token_id: int) -> torch.Tensor:
        decoder = decoder_of(self._model)
        if decoder is not None:
            return decoder.forward([KVRow(self.cache)], [token_id])[0]
        return self.prefill(torch.tensor([token_id], dtype=torch.long))

    def pop_retrieval_seconds(self) -> float:
        return 0.0

    def decode_row(self, token_id: int) -> DecodeRow:
        return KVRow(self.cache)


@torch.inference_mode()
def forward_kv(model: Any, states: Sequence[KVCacheState], ids: torch.Tensor) -> torch.Tensor:
    """One forward of ids (B, T), row b appended to states[b]'s cache; logits (B, vocab) at the
    last position of each row. On failure no cache has changed."""
    batch = KVBatch([state.cache for state in states])
    positions = batch.begin(ids.shape[1])  # (B, T)
    logits = forward_through(model, ids, positions, batch)  # (B, vocab)
    batch.commit()
    return logits


def decode_batch(
    model: Any,
    states: Sequence[DecodeState],
    token_ids: Sequence[int],
    adapters: Sequence[Any] | None = None,
) -> torch.Tensor:
    """Append token_ids[b] to states[b] for every b in one forward, whatever each state's
    path, row b with adapters[b] (engine/runner/adapter.py) where given and not None; logits
    (B, vocab). On failure no state has changed. A state whose row is a PairedRow
    (engine/runner/contrast.py) takes two rows and gets back their `combine`d logits."""
    rows = [state.decode_row(t) for state, t in zip(states, token_ids, strict=True)]
    adapters = list(adapters or ()) + [None] * (len(rows) - len(adapters or ()))
    flat: list[DecodeRow] = []
    flat_ids: list[int] = []
    spans: list[tuple[int, int]] = []  # row b's parts: flat[start:stop]
    for row, token_id, adapter in zip(rows, token_ids, adapters, strict=True):
        parts = row.parts if isinstance(row, PairedRow) else (row,)
        spans.append((len(flat), len(flat) + len(parts)))
        for part in parts:
            if adapter is not None:
                part.adapter = adapter  # type: ignore[attr-defined]  # read by the lean decode step
            flat.append(part)
            flat_ids.append(token_id)
    logits = decode_rows(model, flat, flat_ids)
    if len(flat) == len(rows):
        return logits
    return torch.stack(
        [
            row.combine(logits[start:stop]) if isinstance(row, PairedRow) else logits[start]
            for row, (start, stop) in zip(rows, spans, strict=True)
        ]
    )


def prefill_chunks(
    state: DecodeState, input_ids: torch.Tensor, chunk_tokens: int, cuts: Sequence[int] = ()
) -> Generator[torch.Tensor | None, None, None]:
    """Prefill input_ids (T,) in chunks of at most chunk_tokens that never straddle a position
    in cuts: yields None after each chunk but the last, then the logits (vocab,) at the last
    position."""
    total = int(input_ids.shape[0])
    bounds, start = [], 0
    for stop in [*sorted(c for c in cuts if 0 < c < total), total]:
        while start < stop:
            bounds.append((start, min(start + chunk_tokens, stop)))
            start = bounds[-1][1]
    for i, (start, end) in enumerate(bounds):
        logits = state.prefill(input_ids[start:end])
        if i + 1 < len(bounds):
            yield None
    yield logits
