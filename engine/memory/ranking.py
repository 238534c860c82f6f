"""Which memory rows a search keeps: the hits of several query rows merged rank by rank
(`fair_union`), laid out per KV head (`padded_rows`), and the query rows of a chunk
(`query_rows`). Shared by the tokens strategy, its key sketch search and neurocache.
"""

from __future__ import annotations

import torch


def query_rows(length: int, n: int) -> torch.Tensor:
    """n evenly spaced token indices of a chunk of `length`, the last one always included."""
    if length <= n:
        return torch.arange(length)
    return torch.linspace(length - 1, 0, n).round().long().flip(0).unique()


def padded_rows(picked: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each KV head's memory rows, ascending, as one (kv_heads, width) tensor, -1 padded."""
    width = max(p.numel() for p in picked)
    out = torch.full((len(picked), width), -1, dtype=torch.long, device=device)
    for head, ids in enumerate(picked):
        out[head, : ids.numel()] = ids.sort().values.to(device)
    return out


def fair_union(ids: torch.Tensor, k: int) -> torch.Tensor:
    """The first k distinct ids of hits (rows, kk) taken rank by rank: every row's best hit,
    then every row's second best, ...; within a rank, rows in the order given.

    Ranking the union by raw score instead lets the rows that have near-copies in memory (the
    repeated filler of a long document) fill all k slots, and the row that matters most - the
    last token, whose logits are returned - loses its hits
    (docs/decisions/016-tokens-search.md)."""
    order = ids.T.reshape(-1)
    order = order[order >= 0]
    if order.numel() == 0:
        return order
    unique, inverse = order.unique(return_inverse=True)
    first = torch.full((unique.numel(),), order.numel(), dtype=torch.long, device=order.device)
    first.scatter_reduce_(0, inverse, torch.arange(order.numel(), device=order.device), "amin")
    return unique[first.argsort()[:k]]
