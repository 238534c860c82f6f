"""Per-request KV caches, so that requests on the plain path can share one forward.

Every request on the plain KV path owns a `KVCache`: per layer, its keys and values (rotated at
their positions, as the model hands them over) in a buffer that grows by doubling (up to the
request's prompt + max_tokens), so a step writes only its new tokens and the cache is copied only
when it doubles. A forward passes its caches as the keyword argument `KV_KWARG`
(engine/runner/attention.py), a `KVBatch` with one cache per row of the batch:

    prefill   input_ids (1, T)  -> the row's cache gets T tokens, causal inside the chunk
    decode    input_ids (B, 1)  -> each row appends its token and attends to its own cache

Rows of a batched decode step have different context lengths; `KVBatch.attend` attends row by
row (one SDPA call per row and layer) rather than padding the rows into one SDPA call with a
key-padding mask, which must copy every row's cache into the padded tensor at every layer of
every step (docs/decisions/010-kv-decode-row-loop.md). On a GPU a varlen/paged kernel would
replace the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.runner.cpu_attention import decode_attention, kernel_ready

_MIN_CAPACITY = 64


class KVCache:
    """One request's keys and values for every layer: (layers, 2, kv_heads, capacity, head_dim).

    A forward first `begin`s (reserving room for its T tokens), every layer `write`s its new keys
    and values at the end, and the tokens count only after `commit`: a forward that fails leaves
    the cache as it was (`abort`), so the request can run the step again, alone.
    """

    def __init__(
        self, model: Any, max_tokens: int | None = None, dtype: torch.dtype | None = None
    ) -> None:
        cfg = model.config
        param = next(model.parameters())
        self.num_layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(cfg.num_key_value_heads or cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.head_dim = int(head_dim)
        self.max_tokens = max_tokens  # growth stops here (the request's prompt + max_tokens)
        # what keys and values are kept in (EngineConfig.kv_dtype): the model's, or float16
        self._dtype, self._device = dtype or param.dtype, param.device
        self._buffer: torch.Tensor | None = None  # (layers, 2, kv_heads, capacity, head_dim)
        self.num_tokens = 0  # committed tokens
        self._pending = 0  # tokens of the forward in progress

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else int(self._buffer.shape[3])

    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()

    def begin(self, num_new: int) -> int:
        """Reserve room for num_new tokens; returns their first position."""
        needed = self.num_tokens + num_new
        if needed > self.capacity:
            grown = max(_MIN_CAPACITY, 2 * self.capacity)
            if self.max_tokens is not None:
                grown = min(grown, self.max_tokens)
            self._grow(max(needed, grown))
        self._pending = num_new
        return self.num_tokens

    def _grow(self, capacity: int) -> None:
        buffer = torch.empty(
            (self.num_layers, 2, self.kv_heads, capacity, self.head_dim),
            dtype=self._dtype,
            device=self._device,
        )
        if self._buffer is not None and self.num_tokens:
            buffer[:, :, :, : self.num_tokens] = self._buffer[:, :, :, : self.num_tokens]
        self._buffer = buffer

    def write(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the forward's key/value (kv_heads, T, d) at layer; return the layer's keys and
        values so far, new ones included, as views (kv_heads, num_tokens + T, d)."""
        assert self._buffer is not None and key.shape[1] == self._pending, "write before begin"
        end = self.num_tokens + self._pending
        self._buffer[layer, 0, :, self.num_tokens : end] = key
        self._buffer[layer, 1, :, self.num_tokens : end] = value
        return self._buffer[layer, 0, :, :end], self._buffer[layer, 1, :, :end]

    def start_from(self, kv: torch.Tensor) -> None:
        """Hold kv (layers, 2, kv_heads, n, d), an earlier prompt's first n tokens, as this
        empty cache's first n tokens (engine/caches/kv_prefix.py)."""
        assert self.num_tokens == 0 and self._pending == 0, "start_from an empty cache"
        n = int(kv.shape[3])
        self.begin(n)
        assert self._buffer is not None
        self._buffer[:, :, :, :n] = kv
        self.commit()

    def prefix(self, n: int) -> torch.Tensor:
        """A copy of the first n committed tokens' keys and values (layers, 2, kv_heads, n, d)."""
        assert self._buffer is not None and n <= self.num_tokens
        return self._buffer[:, :, :, :n].clone()

    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's committed keys and values, as views (kv_heads, num_tokens, d)."""
        assert self._buffer is not None, "an empty cache"
        return (
            self._buffer[layer, 0, :, : self.num_tokens],
            self._buffer[layer, 1, :, : self.num_tokens],
        )

    def commit(self) -> None:
        self.num_tokens += self._pending
        self._pending = 0

    def abort(self) -> None:
        self._pending = 0


class KVBatch:
    """The caches of one forward's rows (the forward keyword `KV_KWARG`)."""

    def __init__(self, caches: Sequence[KVCache]) -> None:
        self.caches = list(caches)

    def begin(self, num_new: int) -> torch.Tensor:
        """Reserve num_new tokens in every row; position ids (B, num_new) of the new tokens."""
        starts = [cache.begin(num_new) for cache in self.caches]
        device = self.caches[0]._device
        base = torch.tensor(starts, dtype=torch.long, device=device).view(-1, 1)  # (B, 1)
        return base + torch.arange(num_new, device=device).view(1, -1)  # (B, T)

    def commit(self) -> None:
        for cache in self.caches:
            cache.commit()

    def abort(self) -> None:
        for cache in self.caches:
            cache.abort()

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """query (B, H, T, d), key/value (B, kv_heads, T, d) of one layer: every row's new keys
        and values join its cache, and the row attends to its own cache -> (B, T, H, d)."""
        if len(self.caches) != query.shape[0]:
            raise ValueError(f"{len(self.caches)} caches for a batch of {query.shape[0]} rows")
        rows = []
        for row, cache in enumerate(self.caches):
            keys, values = cache.write(layer, key[row], value[row])  # (kv_heads, S, d)
            rows.append(attend_cache(query[row : row + 1], keys[None], values[None], scaling))
        out = rows[0] if len(rows) == 1 else torch.cat(rows)  # (B, H, T, d)
        return out.transpose(1, 2).contiguous()


def attend_cache(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """query (1, H, T, d) over keys/values (1, kv_heads, S, d), the last T keys being the
    query's own tokens (causal among them) -> (1, H, T, d). One token on a float32 CPU
    model: engine/runner/cpu_attention.py's split-key kernel (SDPA reads this shape slowly), which
    also reads a float16 cache; other shapes attend the cache in the query's dtype."""
    num_new, num_keys = query.shape[2], keys.shape[2]
    if num_new == 1 and kernel_ready(query) and keys.dtype in (torch.float32, torch.float16):
        heads, kv_heads, d = query.shape[1], keys.shape[1], query.shape[-1]
        grouped = query.reshape(kv_heads, heads // kv_heads, d)  # a kv head's queries as rows
        return decode_attention(grouped, keys[0], values[0], scaling).view(1, heads, 1, d)
    mask = None
    if num_new > 1:
        past = num_keys - num_new
        rows = torch.arange(num_new, device=query.device).view(-1, 1)
        cols = torch.arange(num_keys, device=query.device).view(1, -1)
        mask = cols <= rows + past  # (T, S)
    return torch.nn.functional.scaled_dot_product_attention(
        query,
        keys.to(query.dtype),
        values.to(query.dtype),
        attn_mask=mask,
        scale=scaling,
        enable_gqa=query.shape[1] != keys.shape[1],
    )
