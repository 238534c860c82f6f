"""tokens' search over one layer's memory keys, from a float16 dimension-major copy of them.

    sketch = KeySketch(kv_heads, head_dim, device)
    sketch.add(k_pre)                          # (kv_heads, n, d) pre-rotary keys, as memory grows
    rows = search(queries, sketch, keys, ...)  # (kv_heads, R, d) -> (kv_heads, width) memory rows

`KeySketch` holds the pre-rotary keys dimension-major in float16 (one dimension of every key is
one contiguous run) and each dimension's sum of squares. By default every key is scored on all
its dimensions straight from the sketch: streamed, that costs less than picking candidates
(docs/decisions/051-tokens-exact-scan.md). With `candidates` (the SparQ-style search of
docs/decisions/046-tokens-two-level-search.md) a partial score on a few dimensions picks
candidates, scored exactly on the frame's memory keys (`LayerStore.mem_k`, with `block_local`
rotated by their offset in their block: a key at offset o is scored with the query rotated by
o). engine/csrc/token_search.cpp does a layer's search in one call; `search_torch` is the same
in torch ops (other devices, or no compiler).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.cpu_extensions import load_extension
from engine.memory.rotary import RotaryTable


class KeySketch:
    """(kv_heads, d, n) float16 pre-rotary keys, dimension-major, growing along n; FIFO drops."""

    def __init__(self, kv_heads: int, head_dim: int, device: torch.device) -> None:
        self.data = torch.empty(kv_heads, head_dim, 0, dtype=torch.float16, device=device)
        self.squares = torch.zeros(kv_heads, head_dim, dtype=torch.float64, device=device)
        self.start = 0
        self.size = 0
        self._rms: torch.Tensor | None = None

    def add(self, k_pre: torch.Tensor) -> None:  # (kv_heads, n, d)
        n = k_pre.shape[1]
        capacity = self.data.shape[2]
        if self.start + self.size + n > capacity:
            grown = max(2 * self.size + n, 1024)
            data = self.data.new_empty(self.data.shape[0], self.data.shape[1], grown)
            data[:, :, : self.size] = self.view()
            self.data, self.start = data, 0
        end = self.start + self.size
        self.data[:, :, end : end + n] = k_pre.transpose(1, 2)
        self.squares += k_pre.double().square().sum(1)
        self.size += n
        self._rms = None

    def drop_front(self, n: int) -> None:
        n = min(n, self.size)
        self.squares -= self.view()[:, :, :n].double().square().sum(2)
        self.start += n
        self.size -= n
        self._rms = None

    def view(self) -> torch.Tensor:
        return self.data[:, :, self.start : self.start + self.size]

    def rms(self) -> torch.Tensor:
        """(kv_heads, d) float32: each dimension's root mean square over the keys held (kept
        until the keys change: every decode step of every layer asks)."""
        if self._rms is None:
            self._rms = (self.squares.clamp(min=0) / max(self.size, 1)).sqrt().float()
        return self._rms

    def to(self, device: torch.device) -> None:
        self.data, self.start = self.view().to(device).contiguous(), 0
        self.squares = self.squares.to(device)
        self._rms = None

    def __deepcopy__(self, memo: dict[int, Any]) -> KeySketch:
        """The held keys only (SessionMemory.fork): spare capacity is not copied."""
        twin = KeySketch.__new__(KeySketch)
        twin.data, twin.squares = self.view().clone(), self.squares.clone()
        twin.start, twin.size, twin._rms = 0, self.size, self._rms
        memo[id(self)] = twin
        return twin

    def nbytes(self) -> int:
        return self.size * self.data.shape[0] * self.data.shape[1] * self.data.element_size()


def search(
    queries: torch.Tensor,
    sketch: KeySketch,
    keys: torch.Tensor,
    rotary: RotaryTable,
    block_local: bool,
    k: int,
    block: int,
    dims: int,
    candidates: int,
    position: int | None = None,
) -> torch.Tensor:
    """queries (kv_heads, R, d), each head's rows in rank order, rotated by the rotary
    `position` first when it is given; keys (kv_heads, n, d) the frame's memory keys ->
    (kv_heads, width) memory rows: each head's first k distinct hits taken rank by rank over
    its rows (tokens.fair_union), ascending, -1 padded. Every key is scored exactly, on the
    sketch, when candidates is 0 or at least n / 2, or dims at least d; else
    each row scores its `dims` dimensions with the largest |q_i| * rms_i, and about
    `candidates` rows of the best partial scores are scored exactly (in the kernel, those of
    any row of the head, for every row of it)."""
    kernels = _kernels(queries, keys)
    if candidates <= 0:
        candidates = keys.shape[1]
    candidates = max(candidates, k)
    if kernels is not None:  # one call for the layer (engine/csrc/token_search.cpp)
        return kernels.search(
            queries.float().contiguous(), keys, sketch.view(), sketch.rms(),
            rotary.cos, rotary.sin, block_local, k, block, dims, candidates,
            -1 if position is None else position,
        )  # fmt: skip
    if position is not None:
        queries = rotary.rotate(queries, torch.tensor([position], device=queries.device))
    return search_torch(queries, sketch, keys, rotary, block_local, k, block, dims, candidates)


def search_torch(
    queries: torch.Tensor,
    sketch: KeySketch,
    keys: torch.Tensor,
    rotary: RotaryTable,
    block_local: bool,
    k: int,
    block: int,
    dims: int,
    candidates: int,
) -> torch.Tensor:
    """`search` in torch ops. Every key exactly from the sketch, as the kernel does, or the
    candidates: the exact top `candidates` partial scores (the kernel takes about as many, by a
    sampled threshold), scored exactly on the frame's keys."""
    from engine.memory.tokens import fair_union, padded_rows  # tokens imports this module

    kvh, R, d = queries.shape
    n = keys.shape[1]
    q = queries.float()
    if dims >= d or 2 * candidates >= n:  # every key exactly, on the sketch's pre-rotary keys
        scores = q @ sketch.view().to(q.device).float()  # (kv_heads, R, n)
        hits = scores.sort(dim=-1, descending=True, stable=True).indices[..., : min(k, n)]
        return padded_rows([fair_union(hits[h], k) for h in range(kvh)], keys.device)
    weight = q.abs() * sketch.rms().to(q.device)[:, None, :]  # (kv_heads, R, d)
    chosen = weight.topk(dims, dim=-1).indices
    sparse = torch.zeros_like(q).scatter_(-1, chosen, q.gather(-1, chosen))
    partial = sparse @ sketch.view().to(q.device).float()  # (kv_heads, R, n)
    rows = partial.topk(candidates, dim=-1).indices
    heads = torch.arange(kvh, device=keys.device)[:, None, None]
    picked = keys[heads, rows].float()  # (kv_heads, R, C, d)
    if block_local:
        offsets = torch.arange(block, device=q.device)
        per_offset = rotary.rotate(q[:, :, None, :].expand(kvh, R, block, d), offsets)
        q_rows = per_offset.gather(2, (rows % block)[..., None].expand(-1, -1, -1, d))
    else:
        q_rows = q[:, :, None, :]
    scores = (q_rows * picked).sum(-1)  # (kv_heads, R, C)
    # best first, the lower row on ties, as the kernel ranks
    order = torch.sort(rows, dim=-1).indices
    rows, scores = rows.gather(-1, order), scores.gather(-1, order)
    best = scores.sort(dim=-1, descending=True, stable=True).indices[..., : min(k, rows.shape[-1])]
    hits = rows.gather(-1, best)
    return padded_rows([fair_union(hits[h], k) for h in range(kvh)], keys.device)


def _kernels(queries: torch.Tensor, keys: torch.Tensor) -> Any | None:
    cpu = queries.device.type == "cpu" and keys.device.type == "cpu"
    held = keys.dtype in (torch.float16, torch.float32) and keys.stride(2) == 1
    return load_extension("token_search") if cpu and held else None
