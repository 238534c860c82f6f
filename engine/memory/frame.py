"""The frame every forward attends to, and the per-layer stores behind it.

```
[ sinks | retrieved memory, in document order | local window | current tokens ]
  S       R (the strategy's budget)              W              T
```

Each layer keeps pre-rotary keys and values of its sinks, local window and memory. A forward
chunk attends to all of the sinks and local window, to the memory tokens its strategy selects,
and causally to itself. After the forward (`commit`), the chunk's keys and values join the
sinks (until S are held), then the local window; whenever the window holds more than W tokens,
its oldest `block` tokens move to memory, so memory grows in whole blocks and the window keeps
between W - block + 1 and W tokens. With a capacity m, the oldest memory blocks are dropped.
A chunk read without retrieval once memory is in use (a document's body) attends the sinks
and a band of at least `read_window` tokens before each of its tokens, not the whole window.

Positions. While nothing has reached memory, the frame is the plain context and every token
sits at its document position: the forward is then the model's own attention. Once memory is
in use, positions are budgets: sinks at 0..S-1, retrieved tokens at S.. in document order,
the local window right-aligned to end at S+R+W-1 (so its distances to the current tokens are
the true ones), and current token t at S+R+W+t. Unused budget is a gap.

A decode step (one token, memory in use) does not rebuild that frame. Its window would sit one
position further left every step, so every window key would be rotated again; instead each
layer keeps its window keys rotated once at their document positions (less a base that keeps
them inside the rotary table), and the step's query is rotated twice: at its frame position for
the sinks and the retrieved tokens, at its document position for the window. Rotary attention
depends only on the distance between query and key, and the window's distances are the true
ones in both layouts, so the logits are the frame's; the pieces are attended without being
concatenated (FrameState._attend_step).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.memory.config import FrameConfig
from engine.memory.rotary import Angles, RotaryTable

BAND_ROWS = 128  # query rows per attention call of a reading chunk (FrameState._attend_band)


@functools.cache
def _native_bfloat16(device_type: str) -> bool:
    """Whether this machine multiplies bfloat16 matrices natively (so attention in bfloat16 is
    faster than in fp32 rather than emulated): a CPU with AMX or AVX512-BF16, a CUDA GPU that
    supports bfloat16."""
    if device_type == "cpu":
        cpu = torch.cpu
        return any(
            bool(getattr(cpu, name, lambda: False)())
            for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
        )
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return False


def read_dtype(setting: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a reading chunk's band attention computes in (FrameConfig.read_dtype)."""
    if setting == "bfloat16":
        return torch.bfloat16
    if setting == "auto" and model_dtype == torch.float32 and _native_bfloat16(device.type):
        return torch.bfloat16
    return model_dtype


class GrowingBuffer:
    """(heads, n, dim) with amortised O(1) appends along n and O(1) drops from the front.

    Rows live in data[:, start : start + size]; an append that does not fit moves the live
    rows to the front when that frees at least half the capacity, else doubles it, so each row
    is copied a constant number of times on average (a sliding local window is not re-copied
    whole on every commit).

    pin: keep the data in page-locked host memory (a host tier feeding a CUDA device), so
    copies of retrieved rows to the device can run asynchronously."""

    def __init__(
        self,
        heads: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
        pin: bool = False,
    ) -> None:
        self.data = torch.empty(heads, 0, dim, dtype=dtype, device=device)
        self.start = 0
        self.size = 0
        self.pin = pin and device.type == "cpu" and torch.cuda.is_available()

    def append(self, x: torch.Tensor) -> None:  # x (heads, n, dim)
        n = x.shape[1]
        capacity = self.data.shape[1]
        if self.start + self.size + n > capacity:
            live = self.view()
            if self.size + n <= capacity // 2:
                self.data[:, : self.size] = live.clone()
            else:
                capacity = max(2 * capacity, self.size + n, 256)
                grown = self.data.new_empty(self.data.shape[0], capacity, self.data.shape[2])
                if self.pin:
                    grown = grown.pin_memory()
                grown[:, : self.size] = live
                self.data = grown
            self.start = 0
        end = self.start + self.size
        self.data[:, end : end + n] = x.to(self.data.device)
        self.size += n

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device, pin: bool = False) -> None:
        """Move the held rows (only those: spare capacity is dropped) to device."""
        data = self.view().to(device).contiguous()  # take() reads the buffer as flat rows
        self.pin = pin and device.type == "cpu" and torch.cuda.is_available()
        self.data = data.pin_memory() if self.pin else data.clone()
        self.start = 0

    def drop_front(self, n: int) -> None:
        n = min(n, self.size)
        self.start += n
        self.size -= n

    def view(self) -> torch.Tensor:
        return self.data[:, self.start : self.start + self.size]

    def take(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows idx (heads, R) of each head, in range -> (heads, R, dim). One index_select of
        whole rows over the flat buffer: a row is one copy, where `gather` along the rows
        reads element by element (measured 2.2 ms against 7.9 ms for 1536 rows of 3 heads)."""
        heads, capacity, dim = self.data.shape
        offsets = torch.arange(heads, device=idx.device)[:, None] * capacity + self.start
        rows = (idx + offsets).reshape(-1)
        return self.data.view(heads * capacity, dim).index_select(0, rows).view(heads, -1, dim)

    def nbytes(self) -> int:
        """Bytes of the rows held (the capacity behind them, grown by doubling, is up to twice
        that while a session grows)."""
        return self.size * self.data.shape[0] * self.data.shape[2] * self.data.element_size()


@dataclass
class LayerStore:
    """One layer's pre-rotary keys and values, each (kv_heads, n, head_dim): sinks (fixed once
    filled), the local window and memory (growing buffers)."""

    sink_k: torch.Tensor
    sink_v: torch.Tensor
    window_k: GrowingBuffer
    window_v: GrowingBuffer
    mem_k: GrowingBuffer
    mem_v: GrowingBuffer

    @property
    def local_k(self) -> torch.Tensor:
        return self.window_k.view()

    @property
    def local_v(self) -> torch.Tensor:
        return self.window_v.view()

    def to(self, device: torch.device, memory_device: torch.device, pin: bool) -> None:
        self.sink_k, self.sink_v = self.sink_k.to(device), self.sink_v.to(device)
        self.window_k.to(device)
        self.window_v.to(device)
        self.mem_k.to(memory_device, pin)
        self.mem_v.to(memory_device, pin)

    def nbytes(self) -> int:
        buffers = (self.window_k, self.window_v, self.mem_k, self.mem_v)
        return sum(t.numel() * t.element_size() for t in (self.sink_k, self.sink_v)) + sum(
            b.nbytes() for b in buffers
        )


class Selector(Protocol):
    """What a strategy plugs into the frame."""

    def select(
        self, layer: int, q_pre: torch.Tensor, store: LayerStore, scaling: float
    ) -> torch.Tensor | None:
        """q_pre (kv_heads, group, T, head_dim) pre-rotary queries of the chunk -> memory
        indices (kv_heads, R) ascending per head, -1 for padding; None for nothing."""
        ...

    def on_memory_added(self, layer: int, k_pre: torch.Tensor, v: torch.Tensor) -> None:
        """Whole blocks (kv_heads, n * block, head_dim) joined the end of this layer's memory,
        oldest first (views valid during the call only: copy what you keep)."""
        ...

    def on_memory_dropped(self, layer: int, n: int) -> None:
        """The n oldest memory tokens of this layer were dropped (FIFO)."""
        ...

    def nbytes(self) -> int: ...

    # Optional: on_commit(num_new, to_sinks) before a chunk joins the frame, on_abort() when a
    # forward failed, pop_seconds() for retrieval time spent outside `select`;
    # export_chunk_state() -> JSON-able dict of what it keeps from a forwarded chunk beyond its
    # keys and values, and import_chunk_state(state, forwarded) to take it back before commit
    # (forwarded: the chunk was just forwarded, so only replace what the forward computed);
    # wants_vote(num_tokens) -> bool and hold_vote(): SessionMemory then runs that forward
    # twice, aborting the first (a voting pass) and calling hold_vote() between the two.


@dataclass
class _Pending:
    k_pre: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)


class FrameState:
    """A session's frame: the stores of every layer, and the chunk being forwarded."""

    def __init__(
        self,
        config: FrameConfig,
        selector: Selector,
        rotary: RotaryTable,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.selector = selector
        self.rotary = rotary
        self.kv_heads = kv_heads
        empty = torch.empty(kv_heads, 0, head_dim, dtype=dtype, device=device)
        host = config.tier == "host"
        memory_device = torch.device("cpu") if host else device
        self.layers = [
            LayerStore(
                empty,
                empty,
                GrowingBuffer(kv_heads, head_dim, dtype, device),
                GrowingBuffer(kv_heads, head_dim, dtype, device),
                GrowingBuffer(kv_heads, head_dim, dtype, memory_device, pin=host),
                GrowingBuffer(kv_heads, head_dim, dtype, memory_device, pin=host),
            )
            for _ in range(num_layers)
        ]
        self.n_sinks = 0
        self.n_local = 0
        self.n_memory = 0  # tokens in memory now
        self.memory_used = False  # memory has ever held a token: positions are budgets from now
        self.num_tokens = 0
        self.retrieval_seconds = 0.0
        self.last_selected: dict[int, torch.Tensor] = {}  # layer -> (kv_heads, R), for tests
        self._positions: torch.Tensor | None = None
        self._pending = _Pending()
        self._mask_cache: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        # fixed by begin() for all layers of a forward: the rotary angles of the chunk and of
        # the window tokens it attends, and how many of the oldest window tokens it skips
        self._chunk_angles: Angles | None = None
        self._window_angles: Angles | None = None
        self._step_angles: Angles | None = None  # a decode step's query, in the window's frame
        self._window_skip = 0
        self._sinks_rotated: dict[int, torch.Tensor] = {}
        self._device = device
        # decode steps: per layer, the window's keys rotated at (document position - base),
        # built at the first step and kept in step with the window by commit; None when unbuilt
        self._step_window: list[GrowingBuffer] | None = None
        self._step_base = 0
        # decode steps: per layer, the last step's retrieval (idx, rotated keys, values), reused
        # while a step retrieves the same rows (segments: most steps of most layers); dropped by
        # any longer forward, a FIFO drop (rows shift) and a move
        self._step_retrieved: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # -- tiers -------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    def to(self, device: torch.device) -> None:
        """Move the whole frame (sinks, window, memory, the strategy's structures) to device;
        with tier "host" the memory blocks stay on the host whatever the device."""
        device = torch.device(device)
        host = self.config.tier == "host"
        memory_device = torch.device("cpu") if host else device
        for store in self.layers:
            store.to(device, memory_device, pin=host)
        self._sinks_rotated = {}
        self._step_window = None
        self._step_retrieved.clear()
        move = getattr(self.selector, "to", None)
        if move is not None:
            move(device)
        self._device = device

    # -- positions ---------------------------------------------------------------------------

    def begin(self, num_new: int) -> torch.Tensor:
        """Fix the frame positions of the next chunk of num_new tokens, (num_new,)."""
        c = self.config
        if self.memory_used:
            first = c.sinks + c.retrieval_budget + c.local_window
        else:
            first = self.n_sinks + self.n_local
        self._positions = torch.arange(first, first + num_new, device=self._device)
        self._pending = _Pending()
        if num_new > 1:
            self._step_retrieved.clear()
        self._mask_cache = {}
        self._chunk_angles = self.rotary.angles(self._positions)
        self._window_skip = self.n_local - self._window_seen(num_new)
        self._window_angles = self.rotary.angles(self._local_positions()[self._window_skip :])
        self._step_angles = None
        if num_new == 1 and self.memory_used:  # a decode step: FrameState._attend_step
            self._build_step_window()
            step = torch.tensor([self.num_tokens - self._step_base], device=self._device)
            self._step_angles = self.rotary.angles(step)
        return self._positions

    def query_at_retrieval_distance(self, q_pre: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """q_pre (..., len(rows), d), pre-rotary queries of the chunk's tokens `rows`, rotated by
        their distance to the middle of the retrieved span: their inner product with a
        pre-rotary key is then the attention logit that key would get once retrieved (rotary
        attention depends only on q, k and their distance). Searching pre-rotary keys with
        pre-rotary queries instead scores every key as if it sat at the query's own position,
        where the high-frequency dimensions count fully; retrieved keys sit a window away.
        Measured on SmolLM2-135M passkey at 4K tokens (tokens strategy, k 256): the key's digits
        reached the frame in 26 of 90 (layer, KV head) pairs unrotated, 60 of 90 rotated."""
        assert self._positions is not None, "FrameState.begin() was not called"
        middle = self.config.sinks + self.config.retrieval_budget // 2
        distance = (self._positions[rows] - middle).clamp(min=0)
        return self.rotary.rotate(q_pre, distance)

    def _local_positions(self) -> torch.Tensor:
        c = self.config
        end = (
            c.sinks + c.retrieval_budget + c.local_window
            if self.memory_used
            else (self.n_sinks + self.n_local)
        )
        return torch.arange(end - self.n_local, end, device=self._device)

    def _rotated_sinks(self, layer: int) -> torch.Tensor:
        """The layer's sink keys rotated at 0..n_sinks-1, where they always sit: rotated once,
        kept until a commit adds sinks or the frame moves."""
        cached = self._sinks_rotated.get(layer)
        if cached is None or cached.shape[1] != self.n_sinks:
            positions = torch.arange(self.n_sinks, device=self._device)
            cached = self._sinks_rotated[layer] = self.rotary.rotate(
                self.layers[layer].sink_k, positions
            )
        return cached

    def _window_seen(self, num_new: int) -> int:
        """How many of the local window's newest tokens a forward of num_new tokens attends:
        all of them, except that a reading chunk (a forward that does not retrieve) of a
        document already longer than the frame sees only the newest `read_window`."""
        c = self.config
        if c.read_window and self.memory_used and not c.retrieves(num_new):
            return min(c.read_window, self.n_local)
        return self.n_local

    # -- the attention of one layer ----------------------------------------------------------

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """query (1, H, T, d), key/value (1, kv_heads, T, d), rotated at the chunk's positions
        -> attention output (1, T, H, d)."""
        chunk_angles, window_angles = self._chunk_angles, self._window_angles
        assert chunk_angles is not None and window_angles is not None, "begin() was not called"
        store = self.layers[layer]
        kvh, T = key.shape[1], key.shape[2]
        group = query.shape[1] // kvh
        self._pending.k_pre[layer] = self.rotary.unrotate(key[0], chunk_angles)
        self._pending.v[layer] = value[0]
        if self._window_skip:  # a reading chunk once memory is in use: it retrieves nothing
            return self._attend_band(layer, query, key, value, window_angles, scaling, group)

        keys = [self._rotated_sinks(layer)]
        values = [store.sink_v]
        retrieved_ok: torch.Tensor | None = None  # (kv_heads, R) False at padding, if any

        if self.n_memory and self.config.retrieves(T):  # no selector retrieves otherwise
            start = time.perf_counter()
            q_pre = self.rotary.unrotate(query[0], chunk_angles)
            q_pre = q_pre.view(kvh, group, T, -1)
            idx = self.selector.select(layer, q_pre, store, scaling)
            self.retrieval_seconds += time.perf_counter() - start
            if idx is not None and idx.shape[1]:
                self.last_selected[layer] = idx
                ok = idx >= 0
                keys_values = self._step_retrieved.get(layer) if T == 1 else None
                if keys_values is None or not torch.equal(keys_values[0], idx):
                    keys_values = (idx, *self._take_retrieved(store, idx))
                    if T == 1:
                        self._step_retrieved[layer] = keys_values
                keys.append(keys_values[1])
                values.append(keys_values[2])
                if not bool(ok.all()):
                    retrieved_ok = ok

        if T == 1 and self.memory_used:
            return self._attend_step(layer, query, key, value, keys, values, retrieved_ok, scaling)

        keys.append(self.rotary.rotate(store.local_k, window_angles))
        values.append(store.local_v)
        keys.append(key[0])
        values.append(value[0])

        k_frame = torch.cat(keys, dim=1)[None]  # (1, kv_heads, F, d)
        v_frame = torch.cat(values, dim=1)[None]
        P = k_frame.shape[2] - T
        # the session's first chunk attends only itself: plain causal attention, which SDPA's
        # kernels compute without the blocks above the diagonal that an explicit mask costs
        causal = P == 0 and T > 1
        mask = None if causal else self._mask(P, retrieved_ok, T, group, query.dtype)
        out = F.scaled_dot_product_attention(
            query,
            k_frame,
            v_frame,
            attn_mask=mask,
            is_causal=causal,
            scale=scaling,
            enable_gqa=group > 1,
        )
        return out.transpose(1, 2)

    def _take_retrieved(
        self, store: LayerStore, idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Memory rows idx (kv_heads, R) -> their keys rotated at the retrieved slots' frame
        positions, and their values, on the frame's device (host tier: only these rows cross)."""
        rows = idx.clamp(min=0).to(store.mem_k.device)
        mem_k = store.mem_k.take(rows).to(self._device, non_blocking=True)
        mem_v = store.mem_v.take(rows).to(self._device, non_blocking=True)
        frame_pos = self.config.sinks + torch.arange(idx.shape[1], device=self._device)
        return self.rotary.rotate(mem_k, frame_pos), mem_v

    def _attend_band(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        window_angles: Angles,
        scaling: float,
        group: int,
    ) -> torch.Tensor:
        """Attention of a reading chunk once memory is in use (nothing retrieved): every token
        attends the sinks and at least the `read_window` tokens before it, at most
        read_window + BAND_ROWS - 1. Query rows go in blocks of BAND_ROWS; the block starting
        at chunk row s attends the window tokens from its s-th newest of the last read_window
        on, the sinks, and the chunk up to itself, which with keys laid out as
        [window | sinks | chunk] is one contiguous slice: no copy, and a third fewer
        (query, key) pairs than one block attending everything (rotary attention depends only
        on q, k and their distance, so the order of the keys in the slice is free). It computes
        in FrameConfig.read_dtype (bfloat16 on native hardware for an fp32 model)."""
        store, skip = self.layers[layer], self._window_skip
        window_k = self.rotary.rotate(store.local_k[:, skip:], window_angles)
        rw, S, T = window_k.shape[1], self.n_sinks, query.shape[2]
        k_all = torch.cat((window_k, self._rotated_sinks(layer), key[0]), dim=1)[None]
        v_all = torch.cat((store.local_v[:, skip:], store.sink_v, value[0]), dim=1)[None]
        out = query.new_empty(1, T, query.shape[1], query.shape[3])
        dtype = read_dtype(self.config.read_dtype, query.dtype, query.device)
        if dtype != query.dtype:  # see FrameConfig.read_dtype; the output is cast back
            query, k_all, v_all = query.to(dtype), k_all.to(dtype), v_all.to(dtype)
        for s in range(0, T, BAND_ROWS):
            rows = min(BAND_ROWS, T - s)
            start, end = min(s, rw), rw + S + s + rows
            mask = self._mask(end - start - rows, None, rows, group, dtype)
            out[:, s : s + rows] = F.scaled_dot_product_attention(
                query[:, :, s : s + rows],
                k_all[:, :, start:end],
                v_all[:, :, start:end],
                attn_mask=mask,
                scale=scaling,
                enable_gqa=group > 1,
            ).transpose(1, 2)
        return out

    def _attend_step(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        prefix_k: list[torch.Tensor],
        prefix_v: list[torch.Tensor],
        retrieved_ok: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        """Attention of one token once memory is in use: the sinks and retrieved keys
        (prefix_k, rotated at their frame positions) against the query as the model rotated it
        (its frame position), the window's keys rotated at their document positions against
        the query rotated at its own, and the token itself; one softmax over all of them, no
        concatenated frame (see the module docstring)."""
        assert self._chunk_angles is not None and self._step_angles is not None
        assert self._step_window is not None, "begin() builds it for a decode step"
        store = self.layers[layer]
        kvh, d = key.shape[1], key.shape[-1]
        group = query.shape[1] // kvh
        window = self._step_window[layer].view()
        q_window = self.rotary.rotate(
            self.rotary.unrotate(query[0], self._chunk_angles), self._step_angles
        )
        q_frame = query[0].reshape(kvh, group, d)
        q_window = q_window.reshape(kvh, group, d)
        pieces_k = [*prefix_k, window, key[0]]
        pieces_v = [*prefix_v, store.local_v, value[0]]
        logits = [
            q @ k.transpose(1, 2)
            for q, k in zip([q_frame] * len(prefix_k) + [q_window, q_frame], pieces_k, strict=True)
        ]  # (kv_heads, group, n) each
        if retrieved_ok is not None:  # the retrieved slots follow the sinks
            logits[1] = logits[1].masked_fill(~retrieved_ok[:, None, :], float("-inf"))
        weights = (torch.cat(logits, dim=-1).float() * scaling).softmax(dim=-1)
        weights = weights.to(value.dtype).split([k.shape[1] for k in pieces_k], dim=-1)
        out = sum(w @ v for w, v in zip(weights, pieces_v, strict=True))
        assert isinstance(out, torch.Tensor)
        return out.reshape(1, 1, kvh * group, d)

    def _build_step_window(self) -> None:
        """When missing, every layer's window keys rotated at (document position -
        self._step_base), the base being the oldest window token's position."""
        if self._step_window is not None:
            return
        self._step_base = self.num_tokens - self.n_local
        positions = torch.arange(self.n_local, device=self._device)
        self._step_window = []
        for store in self.layers:
            buffer = GrowingBuffer(
                self.kv_heads, store.sink_k.shape[-1], store.sink_k.dtype, self._device
            )
            buffer.append(self.rotary.rotate(store.local_k, positions))
            self._step_window.append(buffer)

    def _mask(
        self,
        P: int,
        retrieved_ok: torch.Tensor | None,
        T: int,
        group: int,
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """Additive mask (1, 1 or H, T, P + T) for a chunk of T tokens after a prefix of P
        slots, all visible except retrieval padding (retrieved_ok (kv_heads, R) False, the R
        slots right after the sinks); None when nothing is hidden (one token, no padding).
        Without padding (reading a chunk, or retrieval that filled its budget) one
        (1, 1, T, P + T) mask is shared by all heads and, cached per forward, by all layers: a
        boolean per-head mask made SDPA build a float copy per layer, which cost as much as a
        fifth of reading a document on CPU."""
        hidden = torch.finfo(dtype).min
        if retrieved_ok is None:
            if T == 1:
                return None
            cached = self._mask_cache.get((P, T, dtype))
            if cached is None:
                cached = torch.zeros(T, P + T, dtype=dtype, device=self._device)
                cached[:, P:].masked_fill_(
                    torch.ones(T, T, dtype=torch.bool, device=self._device).triu(1), hidden
                )
                cached = self._mask_cache[(P, T, dtype)] = cached[None, None]
            return cached
        kvh, R = retrieved_ok.shape
        prefix = torch.zeros(kvh, P, dtype=dtype, device=self._device)
        prefix[:, self.n_sinks : self.n_sinks + R].masked_fill_(~retrieved_ok, hidden)
        causal = torch.zeros(T, T, dtype=dtype, device=self._device)
        causal.masked_fill_(torch.ones_like(causal, dtype=torch.bool).triu(1), hidden)
        mask = torch.cat(
            (prefix[:, None, :].expand(kvh, T, P), causal[None].expand(kvh, T, T)), dim=2
        )  # (kv_heads, T, F)
        return mask.repeat_interleave(group, dim=0)[None]

    # -- after the forward -------------------------------------------------------------------

    def abort(self) -> None:
        if hasattr(self.selector, "on_abort"):
            self.selector.on_abort()
        self._pending = _Pending()
        self._positions = None
        self._chunk_angles = self._window_angles = self._step_angles = None

    def pending_chunk(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The forwarded (not yet committed) chunk's pre-rotary keys and values, one
        (kv_heads, T, head_dim) each per layer."""
        n = len(self.layers)
        return [self._pending.k_pre[i] for i in range(n)], [self._pending.v[i] for i in range(n)]

    def replace_pending(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Commit these keys and values (e.g. their stored fp16 copy) instead of the forward's,
        so a session that wrote a chunk holds exactly what a session rebuilt from it holds."""
        assert self._positions is not None, "FrameState.begin() was not called"
        T = self._positions.shape[0]
        if len(keys) != len(self.layers) or len(values) != len(self.layers):
            raise ValueError(f"need keys and values for {len(self.layers)} layers")
        pending = _Pending()
        store = self.layers[0]
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            if k.shape != (self.kv_heads, T, store.sink_k.shape[-1]) or v.shape != k.shape:
                raise ValueError(f"layer {layer}: expected (kv_heads, {T}, head_dim) keys/values")
            pending.k_pre[layer] = k.to(store.sink_k.device, store.sink_k.dtype)
            pending.v[layer] = v.to(store.sink_k.device, store.sink_k.dtype)
        self._pending = pending

    def begin_import(self, num_new: int) -> None:
        """Ready the frame to commit num_new tokens given by `replace_pending` with no forward."""
        self._positions = torch.arange(num_new, device=self._device)  # only its length is read
        self._pending = _Pending()

    def commit(self) -> None:
        """Move the forwarded chunk into sinks / local window / memory, in every layer."""
        assert self._positions is not None
        num_new = self._positions.shape[0]
        c = self.config
        to_sinks = min(num_new, c.sinks - self.n_sinks)
        if hasattr(self.selector, "on_commit"):
            self.selector.on_commit(num_new, to_sinks)
        for layer, store in enumerate(self.layers):
            k_pre, v = self._pending.k_pre[layer], self._pending.v[layer]
            if to_sinks:
                store.sink_k = torch.cat((store.sink_k, k_pre[:, :to_sinks]), dim=1)
                store.sink_v = torch.cat((store.sink_v, v[:, :to_sinks]), dim=1)
            store.window_k.append(k_pre[:, to_sinks:])
            store.window_v.append(v[:, to_sinks:])
        self._extend_step_window(to_sinks, num_new)
        self.n_sinks += to_sinks
        self.n_local += num_new - to_sinks
        self.num_tokens += num_new
        if self.n_local > c.local_window:
            # the oldest whole blocks that take the window back to at most W tokens, moved at once
            move = -(-(self.n_local - c.local_window) // c.block) * c.block
            for layer, store in enumerate(self.layers):
                blk_k, blk_v = store.local_k[:, :move], store.local_v[:, :move]
                store.mem_k.append(blk_k)
                store.mem_v.append(blk_v)
                # views of the window's rows, valid until the window's next append: selectors
                # copy what they keep
                self.selector.on_memory_added(layer, blk_k, blk_v)
                store.window_k.drop_front(move)
                store.window_v.drop_front(move)
                if self._step_window is not None:
                    self._step_window[layer].drop_front(move)
            self.n_local -= move
            self.n_memory += move
            self.memory_used = True
        while c.m and self.n_memory > c.m:
            self._step_retrieved.clear()
            for layer, store in enumerate(self.layers):
                store.mem_k.drop_front(c.block)
                store.mem_v.drop_front(c.block)
                self.selector.on_memory_dropped(layer, c.block)
            self.n_memory -= c.block
        self._pending = _Pending()
        self._positions = None
        self._chunk_angles = self._window_angles = self._step_angles = None

    def _extend_step_window(self, to_sinks: int, num_new: int) -> None:
        """Rotate the window's new keys into the decode steps' window (commit), or drop that
        window when the newest would fall outside the rotary table (the next step rebuilds it
        from a new base)."""
        if self._step_window is None or to_sinks == num_new:
            return
        first, n = self.num_tokens + to_sinks - self._step_base, num_new - to_sinks
        if first + n >= self.rotary.cos.shape[0]:
            self._step_window = None
            return
        positions = first + torch.arange(n, device=self._device)
        for layer, buffer in enumerate(self._step_window):
            buffer.append(self.rotary.rotate(self._pending.k_pre[layer][:, to_sinks:], positions))

    def release_step_caches(self) -> None:
        """Drop what decode steps keep between steps (the window's rotated keys, the last
        retrieval): the next step rebuilds them. For a session between requests."""
        self._step_window = None
        self._step_retrieved.clear()

    def nbytes(self) -> int:
        step = sum(b.nbytes() for b in self._step_window or ()) + sum(
            k.numel() * k.element_size() + v.numel() * v.element_size()
            for _, k, v in self._step_retrieved.values()
        )
        return sum(s.nbytes() for s in self.layers) + self.selector.nbytes() + step
