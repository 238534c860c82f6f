"""How a frame reads the memory rows its selector chose (Frame.attend's retrieval).

A retrieval is (kv_heads, R) memory row ids, -1 padded. A decode step whose rows are whole
blocks at whole-block slots reads them block-local: in place by the CPU kernel, or gathered
as stored, and the step rotates its query once per block (StepCache.attend). Anything else
(single rows: tokens, neurocache; a multi-token chunk) is gathered and rotated at its frame
slots, right-aligned against the window (docs/decisions/022).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.memory.buffers import GrowingBuffer, LayerStore
from engine.memory.config import FrameConfig
from engine.memory.quantized import QuantizedBuffer
from engine.memory.rotary import Angles, RotaryTable
from engine.memory.step_cache import Retrieved, in_place_ok
from engine.runner.cpu_attention import step_kernels
from engine.runner.cpu_extensions import load_extension


class RowReader:
    """A frame's reads of retrieved memory rows, onto its device in its dtype; int8 rows
    widened to the window's dtype (window_dtype), as the window they are attended beside."""

    def __init__(
        self,
        config: FrameConfig,
        rotary: RotaryTable,
        block_local: bool,
        device: torch.device,
        dtype: torch.dtype,
        window_dtype: torch.dtype | None = None,
    ) -> None:
        self.config, self.rotary, self.block_local = config, rotary, block_local
        self.device, self.dtype = device, dtype
        self.window_dtype = window_dtype or dtype
        self._offsets = torch.arange(config.block, device=device)
        # (idx, its rows clamped, their frame positions, their angles or None) of the forward's
        # last gathered retrieval: layers retrieving the same idx tensor (neurocache's) reuse them
        self.slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor, Angles | None] | None = None

    def to(self, device: torch.device) -> None:
        self.device = device
        self._offsets = self._offsets.to(device)

    def begin(self) -> None:
        """A new forward: its retrievals are new tensors."""
        self.slots = None

    def read(
        self, store: LayerStore, idx: torch.Tensor, query: torch.Tensor, step: bool
    ) -> Retrieved:
        """The memory rows idx (kv_heads, R, -1 padded) as a chunk attends them: a decode step's
        whole blocks read in place by the CPU kernel or gathered block-local, else gathered
        and rotated at their frame slots."""
        whole, padding = self.check_rows(idx, query, step)
        if whole:
            # the kernel reads the rows in place, for a float32 frame (as _gather_kernels):
            # float16 or float32 buffers as they are, int8 ones as codes and scales it
            # dequantizes; elsewhere int8 blocks are widened as they are gathered (quantized.py)
            mem_k, mem_v = store.mem_k, store.mem_v
            if self.dtype == torch.float32:
                rows = idx if padding is None else idx.clamp(min=0)
                if isinstance(mem_k, GrowingBuffer) and in_place_ok(query, mem_k.data):
                    return Retrieved(idx, mem_k.view(), mem_v.view(), "in_place", padding, rows)
                if (
                    isinstance(mem_k, QuantizedBuffer)
                    and isinstance(mem_v, QuantizedBuffer)
                    and in_place_ok(query, mem_k.codes.data)
                ):
                    params = (mem_k.params.view(), mem_v.params.view())
                    codes_k, codes_v = mem_k.codes.view(), mem_v.codes.view()
                    return Retrieved(idx, codes_k, codes_v, "in_place", padding, rows, params)
            return Retrieved(idx, *self.take_blocks(store, idx), "blocks", padding, None)
        return Retrieved(idx, *self.take_rotated(store, idx), "rows", padding, None)

    def take_rotated(
        self, store: LayerStore, idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Memory rows idx (kv_heads, R) -> their keys rotated at the retrieved slots' frame
        positions, and their values, on the frame's device (host tier: only these rows cross)."""
        kept = self.slots
        if kept is None or kept[0] is not idx:
            rows = idx.clamp(min=0)
            # right-aligned against the window: unused budget is a gap after the sinks, and the
            # retrieved text runs into the window as if it preceded it (docs/decisions/022)
            first = self.config.sinks + self.config.retrieval_budget - idx.shape[1]
            frame_pos = first + torch.arange(idx.shape[1], device=self.device)
            if self.block_local:  # stored rotated by their offset in their block already
                frame_pos = frame_pos - rows % self.config.block
            positions = frame_pos.expand_as(idx).contiguous()
            kept = self.slots = (idx, rows.contiguous(), positions, None)
        _, rows, positions, angles = kept
        kernels = self._gather_kernels(store)
        if kernels is not None:  # one call: gathered, widened and rotated (memory_step.cpp)
            k, v = kernels.gather_rotated(
                store.mem_k.view(), store.mem_v.view(), rows, positions,
                self.rotary.cos, self.rotary.sin,
            )  # fmt: skip
            return k, v
        mem_k, mem_v = self.take_blocks(store, idx)
        if angles is None:
            angles = self.rotary.angles(positions)
            self.slots = (idx, rows, positions, angles)
        return self.rotary.rotate(mem_k, angles), mem_v

    def _gather_kernels(self, store: LayerStore) -> Any | None:
        """memory_step.cpp where it gathers this frame's retrieved rows: an fp32 frame on the
        CPU, its memory on the CPU too and not int8, the kernels built."""
        if store.mem_k.quantized:
            return None
        cpu = self.device.type == "cpu" and store.mem_k.device.type == "cpu"
        return load_extension("memory_step") if cpu and self.dtype == torch.float32 else None

    def take_blocks(
        self, store: LayerStore, idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Memory rows idx (kv_heads, R) as stored (keys block-local), on the frame's device
        in its dtype; int8 blocks widened there to the window's dtype (float16 under int4
        weights): a decode step keeps these copies while it retrieves the same rows, where
        float16 blocks are read in place (docs/decisions/070-int8-memory-blocks.md)."""
        rows = idx.clamp(min=0).to(store.mem_k.device)
        dtype = self.window_dtype if store.mem_k.quantized else self.dtype
        mem_k = store.mem_k.take_to(rows, self.device, dtype)
        mem_v = store.mem_v.take_to(rows, self.device, dtype)
        return mem_k, mem_v

    def check_rows(
        self, idx: torch.Tensor, query: torch.Tensor, step: bool
    ) -> tuple[bool, torch.Tensor | None]:
        """(whether a decode step reads the rows idx (kv_heads, R) by whole block, their mask
        False at padding or None when there is none): one kernel call where there are kernels."""
        kernels = step_kernels(query) if step and self.block_local else None
        if kernels is not None:  # engine/runner/csrc/memory_step.cpp
            whole, padded = kernels.whole_blocks(idx.contiguous(), self.config.block)
            return whole, idx >= 0 if padded else None
        ok = idx >= 0
        return step and self.whole_blocks(idx, ok), None if bool(ok.all()) else ok

    def whole_blocks(self, idx: torch.Tensor, ok: torch.Tensor) -> bool:
        """Whether the rows idx (kv_heads, R) are whole memory blocks at whole-block slots
        (padding, ok False, aside): a decode step can then rotate its query per block."""
        block = self.config.block
        if not self.block_local or idx.shape[1] % block:
            return False
        blocks = idx.view(idx.shape[0], -1, block)
        offsets = blocks - blocks[..., :1]
        fits = (offsets == self._offsets) & (blocks[..., :1] % block == 0)
        return bool((fits | ~ok.view_as(blocks)).all())
