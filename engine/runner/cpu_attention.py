"""The CPU decode-attention kernels (engine/runner/csrc/decode_attention.cpp), built on first use.

- `decode_attention(query, keys, values, scale)` attends one decode token of every head to a
  KV cache: query (kv_heads, group, d), keys/values (kv_heads, S, d) views with contiguous rows
  (a KVCache's), float32. It splits the keys into chunks across torch's intra-op threads and
  merges the chunks by log-sum-exp. torch's SDPA on this shape reads the cache at about a
  quarter of the memory bandwidth (docs/decisions/037-lean-decode-step.md).
- `attend_pieces(...)`: one decode token of a memory frame over the step cache's pieces under
  one softmax (engine/memory/step_cache.py), memory rows read in place by index.
- `step_kernels(query)`: engine/runner/csrc/memory_step.cpp, what a memory decode step computes before
  it attends (its rotated queries; segments' block scores), one call each.

They are built on first use (engine/runner/cpu_extensions.py); `load_kernel()` returns None where
that is impossible, and callers then use torch's own ops.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import torch

from engine.runner.cpu_extensions import load_extension

_NO_ROWS = torch.empty(0, dtype=torch.long)
_NO_MASK = torch.empty(0, dtype=torch.bool)
_NO_PARAMS = torch.empty(0, dtype=torch.float16)
MIN_CHUNK = 256  # keys per task below which splitting costs more than it spreads
KEY_BLOCK = 64  # keys a task scores at a time (decode_attention.cpp's kBlock)


def load_kernel() -> Any | None:
    """The compiled extension module, building it on the first call; None if it cannot be."""
    return load_extension("decode_attention")


def kernel_ready(query: torch.Tensor) -> bool:
    """Whether the kernels take this query's attention: float32 on the CPU, the kernels built
    (building them on the first call)."""
    if query.device.type != "cpu" or query.dtype != torch.float32:
        return False
    return load_kernel() is not None


def step_kernels(query: torch.Tensor) -> Any | None:
    """engine/runner/csrc/memory_step.cpp's module (a memory decode step's queries and block scores)
    where the kernels take this query's attention (`kernel_ready`) and it builds; else None."""
    return load_extension("memory_step") if kernel_ready(query) else None


def attend_pieces(
    queries: list[torch.Tensor],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    masks: list[torch.Tensor | None],
    scale: float,
    rows: list[torch.Tensor | None] | None = None,
    params: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    group: int = 0,
) -> torch.Tensor:
    """One decode token over pieces of keys under one softmax: queries[i] (kv_heads, nq,
    group, d), one query per n/nq keys of keys[i]/values[i] (kv_heads, n, d); masks[i]
    (kv_heads, n) bool or None. rows[i] (kv_heads, n) int64, if given: piece i's keys and values
    are read in place, rows[i][h] of keys[i][h] (a memory buffer, no gathered copy). params[i]:
    piece i's keys and values are int8 codes (uint8), dequantized as they are read with these
    float16 (key, value) scales (engine/memory/quantized.py: keys' per channel for each
    `group` rows, values' per row). -> (kv_heads, group, d)."""
    kernel = load_kernel()
    assert kernel is not None, "attend_pieces without a kernel: check load_kernel() first"
    return kernel.attend_pieces(
        *_pieces_args(queries, keys, values, masks, scale, rows, params, group)
    )


def _pieces_args(queries, keys, values, masks, scale, rows, params, group) -> tuple:
    """attend_pieces' arguments as the kernel takes them, with its key splits."""
    rows = rows or [None] * len(queries)
    params = params or [None] * len(queries)
    total = sum(k.shape[1] if r is None else r.shape[1] for k, r in zip(keys, rows, strict=True))
    # tasks of at least MIN_CHUNK keys, about four per thread over the kv heads (a row's own:
    # never the batch's, so that a row's sums do not depend on the rows beside it)
    splits = max(1, min(4 * torch.get_num_threads() // queries[0].shape[0], total // MIN_CHUNK))
    return (
        [q.contiguous() for q in queries],
        keys,
        values,
        [_NO_MASK if m is None else m.contiguous() for m in masks],
        [_NO_ROWS if r is None else r.contiguous() for r in rows],
        [_NO_PARAMS if p is None else p[0] for p in params],
        [_NO_PARAMS if p is None else p[1] for p in params],
        group,
        scale,
        splits,
    )


class Deferred:
    """An attend_pieces call held back to run with the other rows of a layer (PiecesBatch);
    `out` is its result once the batch has run."""

    __slots__ = ("args", "out")

    def __init__(self, args: tuple) -> None:
        self.args = args
        self.out: torch.Tensor | None = None

    def result(self) -> torch.Tensor:
        assert self.out is not None, "the PiecesBatch holding this call has not run"
        return self.out


class PiecesBatch:
    """The attend_pieces calls of a batched decode step's layer, one per memory row, run in one
    kernel call (one parallel region for all rows' tasks, not one per row)."""

    def __init__(self) -> None:
        self.calls: list[Deferred] = []

    def defer(
        self,
        queries: list[torch.Tensor],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        masks: list[torch.Tensor | None],
        scale: float,
        rows: list[torch.Tensor | None] | None = None,
        params: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
        group: int = 0,
    ) -> Deferred:
        """attend_pieces(...) with these arguments, to be run by `run`."""
        call = Deferred(_pieces_args(queries, keys, values, masks, scale, rows, params, group))
        self.calls.append(call)
        return call

    def run(self) -> None:
        """Every deferred call, each call's `out` set; the batch is then empty."""
        if not self.calls:
            return
        kernel = load_kernel()
        assert kernel is not None, "a PiecesBatch without a kernel"
        columns = list(zip(*(call.args for call in self.calls), strict=True))
        for call, out in zip(self.calls, kernel.attend_pieces_rows(*columns), strict=True):
            call.out = out
        self.calls = []


_batch: contextvars.ContextVar[PiecesBatch | None] = contextvars.ContextVar(
    "pieces_batch", default=None
)


def pieces_batch() -> PiecesBatch | None:
    """The PiecesBatch a memory decode step defers its attention to, inside `deferring`."""
    return _batch.get()


@contextlib.contextmanager
def deferring() -> Iterator[PiecesBatch]:
    """Memory rows' attend_pieces calls (StepCache) go to the yielded batch until the block
    ends; the caller runs it."""
    batch = PiecesBatch()
    token = _batch.set(batch)
    try:
        yield batch
    finally:
        _batch.reset(token)


def key_splits(keys: int, kv_heads: int) -> int:
    """Key chunks per kv head for decode_attention: about four tasks per thread over chunks of
    at least MIN_CHUNK keys, and at least enough for the (kv head, chunk) tasks to divide evenly
    among the threads where the keys allow (3 kv heads on 2 threads: 2 chunks, not 1; a layer
    at 505 keys 38 to 29 us)."""
    threads = torch.get_num_threads()
    even = threads // math.gcd(kv_heads, threads)
    return max(1, min(4 * threads, keys // MIN_CHUNK), min(even, keys // KEY_BLOCK))


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """query (kv_heads, group, d), keys/values (kv_heads, S, d) -> (kv_heads, group, d)."""
    kernel = load_kernel()
    assert kernel is not None, "decode_attention without a kernel: check load_kernel() first"
    splits = key_splits(keys.shape[1], keys.shape[0])
    return kernel.decode_attention(query.contiguous(), keys, values, scale, splits)
