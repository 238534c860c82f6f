"""One decode forward for requests on every path: plain KV rows and memory-frame rows together.

A decode step reads every weight of the model once whatever the number of rows, so the next
token of every running request is computed in one forward of input_ids (B, 1). Only attention
differs per row: a `RowBatch` (passed as the forward keyword `KV_KWARG`, engine/runner/attention.py)
hands each layer's row b to its own `DecodeRow`, which attends to the request's own context:

    KVRow       a KVCache (engine/runner/kv_cache.py): the row's cache, as KVBatch attends it
    MemoryRow   a SessionMemory (engine/memory/session.py): the row's frame, with its own
                retrieval, text prior and decode-step caches, as a one-token append reads it

Each row keeps its own position ids (a frame position, or a cache length). A forward that fails
changes no row (every row aborts); one that succeeds commits every row. `decode_rows`
(engine/runner/decode_step.py) runs one such forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.runner.kv_cache import KVCache, attend_cache


class DecodeRow(Protocol):
    """One request's token in a batched decode forward."""

    def begin(self) -> int:
        """Ready the row for one token; its position id."""
        ...

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """query (1, H, 1, d), key/value (1, kv_heads, 1, d) of one layer -> (1, 1, H, d); a
        memory row inside cpu_attention.deferring returns its kernel call instead (a Deferred,
        run by the lean decode step with the other rows')."""
        ...

    def commit(self, logits: torch.Tensor) -> None:
        """The forward succeeded: the token joins the row's context; logits (vocab,) its own."""
        ...

    def abort(self) -> None: ...


class KVRow:
    """A plain request's row: attends to its KV cache."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def begin(self) -> int:
        return self.cache.begin(1)

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        keys, values = self.cache.write(layer, key[0], value[0])  # (kv_heads, S, d)
        return attend_cache(query, keys[None], values[None], scaling).transpose(1, 2)

    def commit(self, logits: torch.Tensor) -> None:
        self.cache.commit()

    def abort(self) -> None:
        self.cache.abort()


class RowBatch:
    """The rows of one decode forward (the forward keyword `KV_KWARG`)."""

    def __init__(self, rows: Sequence[DecodeRow]) -> None:
        self.rows = list(rows)
        self._begun: list[DecodeRow] = []

    def row_of(self, frame: object) -> int | None:
        """The row reading this frame (a MemoryRow's), or None."""
        return next(
            (b for b, r in enumerate(self.rows) if getattr(r, "frame", None) is frame), None
        )

    def begin(self, device: torch.device) -> torch.Tensor:
        """Ready every row; position ids (B, 1). A row failing to begin aborts those begun."""
        positions = []
        try:
            for row in self.rows:
                positions.append(row.begin())
                self._begun.append(row)
        except BaseException:
            self.abort()
            raise
        return torch.tensor(positions, dtype=torch.long, device=device).view(-1, 1)

    def commit(self, logits: torch.Tensor) -> None:
        """logits (B, vocab), row b's at b. (Commits only move tensors a forward computed.)"""
        for b, row in enumerate(self.rows):
            row.commit(logits[b])
            self._begun.remove(row)

    def abort(self) -> None:
        for row in self._begun:
            row.abort()
        self._begun = []

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """query (B, H, 1, d), key/value (B, kv_heads, 1, d) -> (B, 1, H, d), row by row."""
        if len(self.rows) != query.shape[0] or query.shape[2] != 1:
            raise ValueError(f"{len(self.rows)} decode rows for a query of {tuple(query.shape)}")
        out = [
            row.attend(layer, query[b : b + 1], key[b : b + 1], value[b : b + 1], scaling)
            for b, row in enumerate(self.rows)
        ]
        return (out[0] if len(out) == 1 else torch.cat(out)).contiguous()
