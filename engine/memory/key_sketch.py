"""tokens' search over one layer's memory keys: an exact scan of a float16 dimension-major copy
of them (docs/decisions/051-tokens-exact-scan.md).

    sketch = KeySketch(kv_heads, head_dim, device)
    sketch.add(k_pre)                   # (kv_heads, n, d) pre-rotary keys, as memory grows
    rows = search(queries, sketch, ...)  # (kv_heads, R, d) -> (kv_heads, width) memory rows

`KeySketch` holds the pre-rotary keys dimension-major in float16 (one dimension of every key is
one contiguous run), which a streamed scan reads in blocks of 64 keys. The frame's memory keys
are stored rotated by their offset in their block; the rotation cancels in the score, so the
pre-rotary keys rank the same. engine/runner/csrc/token_search.cpp does a layer's search in one call;
`search_torch` is the same in torch ops (other devices, or no compiler). Decisions 046 and 048
searched candidates picked by partial scores instead; the scan costs less and is exact.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.memory.ranking import fair_union, padded_rows
from engine.memory.rotary import RotaryTable
from engine.runner.cpu_extensions import load_extension


class KeySketch:
    """(kv_heads, d, n) float16 pre-rotary keys, dimension-major, growing along n; FIFO drops."""

    def __init__(self, kv_heads: int, head_dim: int, device: torch.device) -> None:
        self.data = torch.empty(kv_heads, head_dim, 0, dtype=torch.float16, device=device)
        self.start = 0
        self.size = 0

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
        self.size += n

    def drop_front(self, n: int) -> None:
        n = min(n, self.size)
        self.start += n
        self.size -= n

    def view(self) -> torch.Tensor:
        return self.data[:, :, self.start : self.start + self.size]

    def to(self, device: torch.device) -> None:
        self.data, self.start = self.view().to(device).contiguous(), 0

    def __deepcopy__(self, memo: dict[int, Any]) -> KeySketch:
        """The held keys only (SessionMemory.fork): spare capacity is not copied."""
        twin = KeySketch.__new__(KeySketch)
        twin.data, twin.start, twin.size = self.view().clone(), 0, self.size
        memo[id(self)] = twin
        return twin

    def nbytes(self) -> int:
        return self.size * self.data.shape[0] * self.data.shape[1] * self.data.element_size()


def search(
    queries: torch.Tensor,
    sketch: KeySketch,
    rotary: RotaryTable,
    k: int,
    position: int | None = None,
) -> torch.Tensor:
    """queries (kv_heads, R, d), each head's rows in rank order, rotated by the rotary
    `position` first when it is given -> (kv_heads, width) memory rows: each head's first k
    distinct hits taken rank by rank over its rows (ranking.fair_union), ascending, -1 padded.
    Every key is scored exactly on the sketch."""
    kernels = _kernels(queries, sketch)
    if kernels is not None:  # one call for the layer (engine/runner/csrc/token_search.cpp)
        return kernels.search(
            queries.float().contiguous(), sketch.view(), rotary.cos, rotary.sin, k,
            -1 if position is None else position,
        )  # fmt: skip
    if position is not None:
        queries = rotary.rotate(queries, torch.tensor([position], device=queries.device))
    return search_torch(queries, sketch, k)


def search_torch(queries: torch.Tensor, sketch: KeySketch, k: int) -> torch.Tensor:
    """`search` in torch ops, the queries as given: ties go to the lower row, as in the kernel."""
    keys = sketch.view()
    scores = queries.float() @ keys.to(queries.device).float()  # (kv_heads, R, n)
    n = keys.shape[2]
    hits = scores.sort(dim=-1, descending=True, stable=True).indices[..., : min(k, n)]
    return padded_rows([fair_union(hits[h], k) for h in range(hits.shape[0])], keys.device)


def _kernels(queries: torch.Tensor, sketch: KeySketch) -> Any | None:
    cpu = queries.device.type == "cpu" and sketch.data.device.type == "cpu"
    return load_extension("token_search") if cpu else None
