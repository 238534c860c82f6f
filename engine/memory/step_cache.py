"""The decode-step path: one token's attention once memory is in use, and what steps keep.

A decode step (one token, memory in use) does not rebuild the frame. Its window would sit one
position further left every step, so every window key would be rotated again; instead each
layer keeps its window keys rotated once at their document positions (less a base that keeps
them inside the rotary table), and the step's query is rotated twice: at its frame position for
the sinks and the retrieved tokens, at its document position for the window. Rotary attention
depends only on the distance between query and key, and the window's distances are the true
ones in both layouts, so the logits are the frame's; the pieces are attended without being
concatenated (StepCache.attend). A step that retrieves the rows the previous step retrieved
reuses their rotated keys and values (StepCache.retrieved; docs/decisions/018-decode-step-caches.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.memory.buffers import GrowingBuffer
from engine.memory.prior import merge_rows
from engine.memory.rotary import Angles
from engine.runner.cpu_attention import (
    Deferred,
    attend_pieces,
    kernel_ready,
    pieces_batch,
    step_kernels,
)

if TYPE_CHECKING:
    from engine.memory.frame_state import FrameState


class Retrieved(NamedTuple):
    """A step's retrieved memory rows idx (kv_heads, R) as it attends them. layout: "rows"
    gathered and rotated at their frame slots; "blocks" gathered whole blocks (block-local
    keys); "in_place" whole blocks the CPU kernel reads from the memory buffers (keys and
    values are the whole buffers' views, rows the row indices; int8 memory: the codes' views,
    and params the (key, value) scales' views). ok: False at padding, or None when there is
    none."""

    idx: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    layout: str
    ok: torch.Tensor | None
    rows: torch.Tensor | None
    params: tuple[torch.Tensor, torch.Tensor] | None = None


class StepQueries(NamedTuple):
    """A step's pre-rotary query (kv_heads, group, d) and key (kv_heads, 1, d), and both
    rotated at its window position (kv_heads, 1, group, d), (kv_heads, 1, d):
    engine/runner/csrc/memory_step.cpp."""

    q_pre: torch.Tensor
    k_pre: torch.Tensor
    q_window: torch.Tensor
    k_window: torch.Tensor


class StepCache:
    """What decode steps keep between steps; dropped by `release` (a session between requests)
    and rebuilt by the next step."""

    def __init__(self) -> None:
        # per layer, the window's keys rotated at (document position - base), built at the
        # first step and kept in step with the window by commit; None when unbuilt
        self.window: list[GrowingBuffer] | None = None
        self.base = 0
        # per layer, the last step's retrieval, reused while a step retrieves the same rows
        # (segments: most steps of most layers); dropped by any longer forward, a FIFO drop
        # (rows shift) and a move
        self.retrieved: dict[int, Retrieved] = {}
        # per layer, the last step's union of the strategy's rows and the text prior's pinned
        # rows: (strategy rows, pinned, union), reused while both are the same
        self.merged: dict[int, tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]] = {}
        self.angles: Angles | None = None  # the step's query, in the window's frame (begin)
        self.frame_position = self.window_position = 0  # the step's query's, in either frame

    def begin(self, frame: FrameState, position: int) -> None:
        """Ready a decode step of the frame, its token at frame position `position`: its window
        (when missing) and its query's angles."""
        self._build_window(frame)
        self.frame_position, self.window_position = position, frame.num_tokens - self.base
        step = torch.tensor([self.window_position], device=frame.device)
        self.angles = frame.rotary.angles(step)

    def queries(
        self, frame: FrameState, query: torch.Tensor, key: torch.Tensor
    ) -> StepQueries | None:
        """query (1, H, 1, d) and key (1, kv_heads, 1, d), rotated at the step's frame position
        -> its StepQueries from one kernel call; None where the kernels do not take them."""
        kernels = step_kernels(query) if frame.held_for_kernels else None
        if kernels is None:
            return None
        heads, kvh, d = query.shape[1], key.shape[1], key.shape[-1]
        rotary = frame.rotary
        return StepQueries(
            *kernels.step_queries(
                query.reshape(heads, d).contiguous(),
                key.reshape(kvh, d).contiguous(),
                rotary.cos,
                rotary.sin,
                self.frame_position,
                self.window_position,
                rotary.scale_sq,
            )
        )

    def _build_window(self, frame: FrameState) -> None:
        """When missing, every layer's window keys rotated at (document position -
        self.base), the base being the oldest window token's position."""
        if self.window is not None:
            return
        self.base = frame.num_tokens - frame.n_local
        positions = torch.arange(frame.n_local, device=frame.device)
        self.window = []
        for store in frame.layers:
            buffer = GrowingBuffer(
                frame.kv_heads, store.sink_k.shape[-1], store.sink_k.dtype, frame.device
            )
            buffer.append(frame.rotary.rotate(store.local_k, positions))
            self.window.append(buffer)

    def extend_window(
        self,
        frame: FrameState,
        k_pre: dict[int, torch.Tensor],
        to_sinks: int,
        num_new: int,
        rotated: dict[int, torch.Tensor],
    ) -> None:
        """Rotate the window's new keys (k_pre, the committed chunk's per layer) into the
        decode steps' window (commit, before the frame counts them), or drop that window when
        the newest would fall outside the rotary table (the next step rebuilds it from a new
        base). rotated: a decode step's key already rotated so (StepQueries.k_window), per
        layer, where the kernels gave it."""
        if self.window is None or to_sinks == num_new:
            return
        first, n = frame.num_tokens + to_sinks - self.base, num_new - to_sinks
        if first + n >= frame.rotary.cos.shape[0]:
            self.window = None
            return
        if len(rotated) == len(self.window) and n == 1 and first == self.window_position:
            for layer, buffer in enumerate(self.window):
                buffer.append(rotated[layer])
            return
        positions = first + torch.arange(n, device=frame.device)
        for layer, buffer in enumerate(self.window):
            buffer.append(frame.rotary.rotate(k_pre[layer][:, to_sinks:], positions))

    def drop_window_front(self, layer: int, n: int) -> None:
        """The window's n oldest tokens of this layer moved to memory."""
        if self.window is not None:
            self.window[layer].drop_front(n)

    def release(self) -> None:
        """Drop the window's rotated keys and the last retrieval: the next step rebuilds them."""
        self.window = None
        self.retrieved.clear()
        self.merged.clear()

    def merge(
        self,
        layer: int,
        idx: torch.Tensor | None,
        pinned: torch.Tensor,
        kv_heads: int,
        keep_order: bool,
    ) -> torch.Tensor:
        """merge_rows(idx, pinned) for a decode step of `layer`, the last step's union when the
        strategy's rows and the pinned tensor are the ones it had."""
        cached = self.merged.get(layer)
        if cached is not None and cached[1] is pinned and _same_rows(cached[0], idx):
            return cached[2]
        union = merge_rows(idx, pinned, kv_heads, keep_order=keep_order)
        self.merged[layer] = (idx, pinned, union)
        return union

    def nbytes(self) -> int:
        return sum(b.nbytes() for b in self.window or ()) + sum(
            kept.keys.numel() * kept.keys.element_size()
            + kept.values.numel() * kept.values.element_size()
            for kept in self.retrieved.values()
            if kept.layout != "in_place"  # the memory's own buffers
        )

    def attend(
        self,
        frame: FrameState,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        prefix_k: list[torch.Tensor],
        prefix_v: list[torch.Tensor],
        retrieved_ok: torch.Tensor | None,
        chunk_angles: Angles,
        scaling: float,
        blocks_at: int | None = None,
        retrieved_rows: torch.Tensor | None = None,
        queries: StepQueries | None = None,
        retrieved_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | Deferred:
        """Attention of one token once memory is in use: the sinks and retrieved keys
        (prefix_k, rotated at their frame positions) against the query as the model rotated it
        (its frame position, chunk_angles), the window's keys rotated at their document
        positions against the query rotated at its own, and the token itself; one softmax over
        all of them, no concatenated frame (see the module docstring). blocks_at: the retrieved
        keys (prefix_k[1]) are whole blocks as stored, each rotated by its offset in its block,
        block j at frame slots blocks_at + j * block onwards; the query is rotated once per
        block to their distance instead (rotary logits depend only on the distance).
        retrieved_rows: prefix_k[1] and prefix_v[1] are the memory's whole buffers, the
        retrieved keys their rows retrieved_rows (kv_heads, R), read in place by the kernel;
        retrieved_params: those buffers are int8 codes, with these (key, value) scales.
        queries: the step's queries from the kernels (StepCache.queries), if they took it."""
        assert self.angles is not None and self.window is not None, "begin() builds them"
        store = frame.layers[layer]
        kvh, d = key.shape[1], key.shape[-1]
        group = query.shape[1] // kvh
        window = self.window[layer].view()
        pieces_k = [*prefix_k, window, key[0]]
        pieces_v = [*prefix_v, store.local_v, value[0]]
        if queries is not None:  # the kernels' path: no torch op but the attention's
            q_frame = query[0].reshape(kvh, 1, group, d)
            qs = [q_frame] * len(prefix_k) + [queries.q_window, q_frame]
            if blocks_at is not None:  # the retrieved blocks: the query rotated per block
                n = prefix_k[1].shape[1] if retrieved_rows is None else retrieved_rows.shape[1]
                block, rotary, kernels = frame.config.block, frame.rotary, step_kernels(query)
                assert kernels is not None, "queries come from the kernels"
                qs[1] = kernels.block_queries(
                    queries.q_pre, rotary.cos, rotary.sin,
                    self.frame_position - blocks_at, n // block, block,
                )  # fmt: skip
            return self._attend_pieces(qs, pieces_k, pieces_v, prefix_k, retrieved_ok,
                                       retrieved_rows, retrieved_params, frame.config.block,
                                       scaling)  # fmt: skip
        q_pre = frame.rotary.unrotate(query[0], chunk_angles)  # (H, 1, d)
        q_window = frame.rotary.rotate(q_pre, self.angles)
        q_frame = query[0].reshape(kvh, group, d)
        q_window = q_window.reshape(kvh, group, d)
        if frame.held_for_kernels and kernel_ready(query):
            qs = [q_frame[:, None]] * len(prefix_k) + [q_window[:, None], q_frame[:, None]]
            if blocks_at is not None:  # the retrieved blocks: the query rotated per block
                n = prefix_k[1].shape[1] if retrieved_rows is None else retrieved_rows.shape[1]
                qs[1] = self._block_queries(frame, q_pre, n, blocks_at, kvh, group)
            return self._attend_pieces(qs, pieces_k, pieces_v, prefix_k, retrieved_ok,
                                       retrieved_rows, retrieved_params, frame.config.block,
                                       scaling)  # fmt: skip
        assert retrieved_rows is None, "memory rows read in place need the CPU kernel"
        logits = [
            q @ k.to(q.dtype).transpose(1, 2)
            for q, k in zip([q_frame] * len(prefix_k) + [q_window, q_frame], pieces_k, strict=True)
            if blocks_at is None or k is not prefix_k[1]
        ]  # (kv_heads, group, n) each
        if blocks_at is not None:
            logits.insert(1, self._block_logits(frame, q_pre, prefix_k[1], blocks_at, kvh, group))
        if retrieved_ok is not None:  # the retrieved slots follow the sinks
            logits[1] = logits[1].masked_fill(~retrieved_ok[:, None, :], float("-inf"))
        weights = (torch.cat(logits, dim=-1).float() * scaling).softmax(dim=-1)
        weights = weights.to(value.dtype).split([k.shape[1] for k in pieces_k], dim=-1)
        out = sum(w @ v.to(w.dtype) for w, v in zip(weights, pieces_v, strict=True))
        assert isinstance(out, torch.Tensor)
        return out.reshape(1, 1, kvh * group, d)

    @staticmethod
    def _attend_pieces(
        queries: list[torch.Tensor],
        pieces_k: list[torch.Tensor],
        pieces_v: list[torch.Tensor],
        prefix_k: list[torch.Tensor],
        retrieved_ok: torch.Tensor | None,
        retrieved_rows: torch.Tensor | None,
        retrieved_params: tuple[torch.Tensor, torch.Tensor] | None,
        block: int,
        scaling: float,
    ) -> torch.Tensor | Deferred:
        """The kernel over the pieces (the retrieved ones, if any, second) -> (1, 1, H, d); in
        a batched step (`deferring`) the call, deferred to run with the other rows'."""
        rows: list[torch.Tensor | None] = [None] * len(pieces_k)
        masks: list[torch.Tensor | None] = [None] * len(pieces_k)
        params: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(pieces_k)
        if len(prefix_k) > 1:
            rows[1], masks[1], params[1] = retrieved_rows, retrieved_ok, retrieved_params
        batch = pieces_batch()
        if batch is not None:
            return batch.defer(queries, pieces_k, pieces_v, masks, scaling, rows, params, block)
        out = attend_pieces(queries, pieces_k, pieces_v, masks, scaling, rows, params, block)
        kvh, group, d = out.shape
        return out.reshape(1, 1, kvh * group, d)

    def _block_queries(
        self, frame: FrameState, q_pre: torch.Tensor, n: int, first: int, kvh: int, group: int
    ) -> torch.Tensor:
        """The query (H, 1, d) pre-rotary, rotated once per block of n block-local keys, block
        j at slots first + j * block: (kv_heads, n/block, group, d)."""
        block, d = frame.config.block, q_pre.shape[-1]
        nb = n // block
        assert frame._positions is not None
        distance = frame._positions - first - block * torch.arange(nb, device=q_pre.device)
        q = q_pre.reshape(kvh, 1, group, d)  # one rotation per block: (kvh, nb, group, d)
        return frame.rotary.rotate(q, distance[:, None])

    def _block_logits(
        self,
        frame: FrameState,
        q_pre: torch.Tensor,
        keys: torch.Tensor,
        first: int,
        kvh: int,
        group: int,
    ) -> torch.Tensor:
        """The query (H, 1, d) pre-rotary against block-local keys (kv_heads, R, d), block j
        at slots first + j * block: (kv_heads, group, R)."""
        block, d = frame.config.block, keys.shape[-1]
        nb = keys.shape[1] // block
        q_blocks = self._block_queries(frame, q_pre, keys.shape[1], first, kvh, group)
        blocks = keys.view(kvh, nb, block, d).to(q_blocks.dtype)
        logits = q_blocks @ blocks.transpose(-1, -2)  # (kvh, nb, g, block)
        return logits.permute(0, 2, 1, 3).reshape(kvh, group, nb * block)


def in_place_ok(query: torch.Tensor, memory: torch.Tensor) -> bool:
    """Whether a decode step reads retrieved memory rows in place (attend_pieces): the kernels
    take the query, and the memory is on the CPU too."""
    return memory.device.type == "cpu" and kernel_ready(query)


def _same_rows(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and bool(torch.equal(a, b))
