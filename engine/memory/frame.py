"""The frame every forward attends to (Frame): its layout, positions and attention.

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
in use, positions are budgets: sinks at 0..S-1, the retrieved tokens in document order ending
at S+R-1, the n tokens the local window holds right after them at S+R..S+R+n-1 (so their
distances to the current tokens are the true ones), and current token t at S+R+n+t. Unused
retrieval budget is a gap after the sinks; retrieved text runs straight into the window, which
after a document ends (`flush_window`) holds only the conversation: evidence right before the
question, as RAG places it (docs/decisions/023-documents-in-memory.md).

`mark` and `rewind` take the frame back to an earlier point (a session's end of documents) as
long as nothing has moved to memory since: the window and sinks forget their newest tokens.

A reading chunk's band is band.py; a decode step (one token, memory in use) runs step_cache.py;
any other chunk attends the whole frame concatenated (chunk.py). Stores are buffers.py; what a
strategy plugs in is selector.py; how the rows it chooses are read is retrieval.py.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.memory.band import attend_band
from engine.memory.chunk import attend_chunk
from engine.memory.config import FrameConfig
from engine.memory.frame_state import FrameMark, FrameState, PendingChunk
from engine.memory.prior import merge_rows
from engine.memory.retrieval import RowReader
from engine.memory.rotary import RotaryTable
from engine.memory.selector import Selector
from engine.memory.step_cache import StepCache
from engine.runner.cpu_attention import Deferred

if TYPE_CHECKING:
    from engine.memory.mapped import DiskArena

# Bumped whenever a chunk's keys and values come out differently for the same tokens (the
# layout of the frame it attends changed): stored encodings of another layout are not reused.
FRAME_LAYOUT = 2


class Frame(FrameState):
    """A session's frame: its state (FrameState), the strategy's selector, and the attention
    and commits that change it."""

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
        window_dtype: torch.dtype | None = None,
        arena: DiskArena | None = None,
        spill_bytes: int = 0,
    ) -> None:
        super().__init__(
            config,
            rotary,
            num_layers,
            kv_heads,
            head_dim,
            dtype,
            device,
            window_dtype,
            arena,
            spill_bytes,
        )
        self.selector = selector
        self.step_cache = StepCache()  # what decode steps keep between steps
        self.reader = RowReader(config, rotary, self.block_local, device, dtype, self.window_dtype)

    # -- tiers -------------------------------------------------------------------------------

    def to(self, device: torch.device) -> None:
        """Move the whole frame (sinks, window, memory, the strategy's structures) to device;
        with tier "host" the memory blocks stay on the host whatever the device, and in the
        disk tier they stay there."""
        device = torch.device(device)
        host = self.config.tier == "host"
        memory_device = torch.device("cpu") if host or self.on_disk else device
        for store in self.layers:
            store.to(device, memory_device, pin=host)
        self._sinks_rotated = {}
        self.step_cache.release()
        self.selector.to(device)
        self._device = device
        self.reader.to(device)

    # -- positions ---------------------------------------------------------------------------

    def begin(self, num_new: int) -> torch.Tensor:
        """Fix the frame positions of the next chunk of num_new tokens, (num_new,)."""
        first = self._window_end()
        self._positions = torch.arange(first, first + num_new, device=self._device)
        self._pending = PendingChunk()
        if num_new > 1:
            self.step_cache.retrieved.clear()
        self.mask_cache = {}
        self.reader.begin()
        self._chunk_angles = self.rotary.angles(self._positions)
        self._window_skip = self.n_local - self._window_seen(num_new)
        self.step_cache.angles = None
        if num_new == 1 and self.memory_used:  # a decode step: StepCache.attend
            self._window_angles = None  # the step cache keeps the window rotated
            self.step_cache.begin(self, first)
        else:
            self._window_angles = self.rotary.angles(self._local_positions()[self._window_skip :])
        return self._positions

    # -- the attention of one layer ----------------------------------------------------------

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor | Deferred:
        """query (1, H, T, d), key/value (1, kv_heads, T, d), rotated at the chunk's positions
        -> attention output (1, T, H, d); a decode step inside cpu_attention.deferring: the
        kernel call, deferred to run with the other rows' (the lean decode step runs it)."""
        chunk_angles, window_angles = self._chunk_angles, self._window_angles
        assert chunk_angles is not None, "begin() was not called"
        store = self.layers[layer]
        kvh, T = key.shape[1], key.shape[2]
        group = query.shape[1] // kvh
        step = T == 1 and self.memory_used  # a decode step: StepCache.attend
        # a step's pre-rotary query and key and its window query, from one kernel call (or None)
        queries = self.step_cache.queries(self, query, key) if step else None
        if queries is not None:
            self._pending.k_pre[layer] = queries.k_pre
            self._pending.k_window[layer] = queries.k_window
        else:
            self._pending.k_pre[layer] = self.rotary.unrotate(key[0], chunk_angles)
        self._pending.v[layer] = value[0]
        if self._window_skip:  # a reading chunk once memory is in use: it retrieves nothing
            skip = self._window_skip
            assert window_angles is not None
            return attend_band(self, layer, query, key, value, window_angles, skip, scaling, group)

        keys = [self.rotated_sinks(layer)]
        values = [store.sink_v]
        retrieved_ok: torch.Tensor | None = None  # (kv_heads, R) False at padding, if any
        by_block = False
        retrieved_rows: torch.Tensor | None = None  # (kv_heads, R) memory rows read in place
        # their int8 scales (key, value), where memory holds codes read in place
        retrieved_params: tuple[torch.Tensor, torch.Tensor] | None = None

        if self.n_memory and self.config.retrieves(T):  # no selector retrieves otherwise
            start = time.perf_counter()
            if queries is not None:
                q_pre = queries.q_pre.view(kvh, group, 1, -1)
            else:
                q_pre = self.rotary.unrotate(query[0], chunk_angles).view(kvh, group, T, -1)
            idx = self.selector.select(layer, q_pre, store, scaling)
            if self.pinned is not None:  # the text prior's rows (prior.py), every layer
                by_relevance = self.config.prior_order == "relevance"
                if T == 1:
                    idx = self.step_cache.merge(layer, idx, self.pinned, kvh, by_relevance)
                else:
                    idx = merge_rows(idx, self.pinned, kvh, keep_order=by_relevance)
            self.retrieval_seconds += time.perf_counter() - start
            if idx is not None and idx.shape[1]:
                self.last_selected[layer] = idx
                kept = self.step_cache.retrieved.get(layer) if T == 1 else None
                if kept is None or (kept.idx is not idx and not torch.equal(kept.idx, idx)):
                    kept = self.reader.read(store, idx, query, step)
                    if T == 1:
                        self.step_cache.retrieved[layer] = kept
                keys.append(kept.keys)
                values.append(kept.values)
                by_block = kept.layout != "rows"
                retrieved_rows, retrieved_ok = kept.rows, kept.ok
                retrieved_params = kept.params

        if step:
            blocks_at = None  # the retrieved keys are block-local: the first slot of block 0
            if len(keys) > 1 and by_block:
                retrieved = keys[1].shape[1] if retrieved_rows is None else retrieved_rows.shape[1]
                blocks_at = self.config.sinks + self.config.retrieval_budget - retrieved
            return self.step_cache.attend(
                self,
                layer,
                query,
                key,
                value,
                keys,
                values,
                retrieved_ok,
                chunk_angles,
                scaling,
                blocks_at,
                retrieved_rows,
                queries,
                retrieved_params,
            )

        assert window_angles is not None
        keys.append(self.rotary.rotate(store.local_k, window_angles))
        values.append(store.local_v)
        return attend_chunk(self, query, key, value, keys, values, retrieved_ok, scaling, group)

    # -- after the forward -------------------------------------------------------------------

    def abort(self) -> None:
        self.selector.on_abort()
        self._pending = PendingChunk()
        self._positions = None
        self._chunk_angles = self._window_angles = self.step_cache.angles = None

    def pending_chunk(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The forwarded (not yet committed) chunk's pre-rotary keys and values, one
        (kv_heads, T, head_dim) each per layer."""
        n = len(self.layers)
        return [self._pending.k_pre[i] for i in range(n)], [self._pending.v[i] for i in range(n)]

    def replace_pending(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Commit these keys and values (e.g. their stored fp16 copy) instead of the forward's,
        so a session that wrote a chunk holds exactly what a session rebuilt from it holds."""
        assert self._positions is not None, "Frame.begin() was not called"
        T = self._positions.shape[0]
        if len(keys) != len(self.layers) or len(values) != len(self.layers):
            raise ValueError(f"need keys and values for {len(self.layers)} layers")
        pending = PendingChunk()
        store = self.layers[0]
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            if k.shape != (self.kv_heads, T, store.sink_k.shape[-1]) or v.shape != k.shape:
                raise ValueError(f"layer {layer}: expected (kv_heads, {T}, head_dim) keys/values")
            pending.k_pre[layer] = k.to(self._device, self._dtype)
            pending.v[layer] = v.to(self._device, self._dtype)
        self._pending = pending

    def begin_import(self, num_new: int) -> None:
        """Ready the frame to commit num_new tokens given by `replace_pending` with no forward."""
        self._positions = torch.arange(num_new, device=self._device)  # only its length is read
        self._pending = PendingChunk()

    def commit(self) -> None:
        """Move the forwarded chunk into sinks / local window / memory, in every layer."""
        assert self._positions is not None
        num_new = self._positions.shape[0]
        c = self.config
        to_sinks = min(num_new, c.sinks - self.n_sinks)
        self.selector.on_commit(num_new, to_sinks)
        for layer, store in enumerate(self.layers):
            k_pre, v = self._pending.k_pre[layer], self._pending.v[layer]
            if to_sinks:
                held = self.window_dtype
                store.sink_k = torch.cat((store.sink_k, k_pre[:, :to_sinks].to(held)), dim=1)
                store.sink_v = torch.cat((store.sink_v, v[:, :to_sinks].to(held)), dim=1)
            store.window_k.append(k_pre[:, to_sinks:])
            store.window_v.append(v[:, to_sinks:])
        pending = self._pending
        self.step_cache.extend_window(self, pending.k_pre, to_sinks, num_new, pending.k_window)
        self.n_sinks += to_sinks
        self.n_local += num_new - to_sinks
        self.num_tokens += num_new
        if self.n_local > c.local_window:
            # the oldest whole blocks that take the window back to at most W tokens, moved at once
            self._move_to_memory(-(-(self.n_local - c.local_window) // c.block) * c.block)
        self._pending = PendingChunk()
        self._positions = None
        self._chunk_angles = self._window_angles = self.step_cache.angles = None

    def flush_window(self) -> None:
        """A document ended: once memory is in use, the window's whole blocks move to memory,
        so what follows (the conversation) attends the document only through retrieval, and
        retrieved text sits right before it. A session that still fits its frame keeps it."""
        if self.memory_used and self.n_local >= self.config.block:
            self._move_to_memory(self.n_local // self.config.block * self.config.block)

    def _move_to_memory(self, move: int) -> None:
        """The window's `move` oldest tokens (whole blocks) join the end of memory; then the
        oldest memory blocks past the capacity m are dropped."""
        c = self.config
        offsets = torch.arange(move, device=self._device) % c.block
        for layer, store in enumerate(self.layers):
            blk_k, blk_v = store.local_k[:, :move], store.local_v[:, :move]
            store.mem_k.append(self.rotary.rotate(blk_k, offsets) if self.block_local else blk_k)
            store.mem_v.append(blk_v)
            # views of the window's rows (in the model's dtype), valid until the window's next
            # append: selectors copy what they keep
            self.selector.on_memory_added(layer, blk_k.to(self._dtype), blk_v.to(self._dtype))
            store.window_k.drop_front(move)
            store.window_v.drop_front(move)
            self.step_cache.drop_window_front(layer, move)
        self.n_local -= move
        self.n_memory += move
        self.moved += move
        self.memory_used = True
        while c.m and self.n_memory > c.m:
            self.step_cache.retrieved.clear()
            for layer, store in enumerate(self.layers):
                store.mem_k.drop_front(c.block)
                store.mem_v.drop_front(c.block)
                self.selector.on_memory_dropped(layer, c.block)
            self.n_memory -= c.block
        self.spill_if_over()

    def mark(self) -> FrameMark:
        """Where the frame stands now, for a later `rewind`."""
        state = self.selector.mark_state()
        return FrameMark(self.num_tokens, self.n_sinks, self.n_local, self.moved, state)

    def can_rewind(self, mark: FrameMark) -> bool:
        """Whether everything committed since `mark` still sits in the sinks and window."""
        return self.moved == mark.moved and self.n_local >= mark.n_local

    def rewind(self, mark: FrameMark) -> bool:
        """Forget every token committed after `mark`, when they all still sit in the sinks and
        the window (nothing has moved to memory since); False, changing nothing, otherwise."""
        if not self.can_rewind(mark):
            return False
        drop_local = self.n_local - mark.n_local
        for store in self.layers:
            store.sink_k = store.sink_k[:, : mark.n_sinks]
            store.sink_v = store.sink_v[:, : mark.n_sinks]
            store.window_k.drop_back(drop_local)
            store.window_v.drop_back(drop_local)
        self.selector.on_rewind(mark.n_local, mark.selector)
        self.step_cache.release()
        self._sinks_rotated = {}
        self.n_sinks, self.n_local, self.num_tokens = mark.n_sinks, mark.n_local, mark.num_tokens
        return True

    def release_step_caches(self) -> None:
        """Drop what decode steps keep between steps (the window's rotated keys, the last
        retrieval): the next step rebuilds them. For a session between requests."""
        self.step_cache.release()

    def nbytes(self) -> int:
        step = self.step_cache.nbytes()
        return sum(s.nbytes() for s in self.layers) + self.selector.nbytes() + step
