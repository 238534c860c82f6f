"""Memory blocks held in 8 bits (FrameConfig.memory_dtype "int8"), KIVI's split (Liu et al.
2024): keys quantized per channel, values per token.

What is quantized is what memory holds: pre-rotary keys, each rotated by its offset in its
block when the rotary is unscaled (block-local, frame_state.py), and values. A key group is one
memory block of one KV head: one (scale, zero) per channel over the block's `block` tokens. A
block-local rotation turns a channel pair by at most block - 1 steps of its frequency, so the
low-frequency channels, where keys' large consistent channels sit, keep their own range, and a
fast pair's range becomes the pair's; blocks are also what moves to memory, what FIFO drops and
what retrieval reads, so every group is whole wherever a block is. A value group is one token
of one KV head, over its head_dim channels. Codes are uint8, asymmetric: x ~ zero + code *
scale, scale and zero in float16 (zero rounded down, scale up, so every x is in range and off
by at most scale / 2). Rows are widened where a block is read (`take_to`, to the window's dtype:
RowReader.take_blocks); the frame, sinks and window keep their own dtype. Why, and what it costs:
docs/decisions/070-int8-memory-blocks.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.memory.buffers import GrowingBuffer, storage_dtype

if TYPE_CHECKING:
    from engine.memory.mapped import DiskArena

LEVELS = 255  # uint8 codes 0..255
HELD = torch.float16  # scales and zeros


class QuantizedBuffer:
    """(heads, n, dim) rows held as uint8 codes plus float16 (scale, zero) per group, with
    GrowingBuffer's appends and front drops.

    group: rows that share one (scale, zero) per channel (keys: a memory block; appends and
    drops then come in whole groups); 0: each row has one (scale, zero) over its channels
    (values)."""

    quantized = True

    def __init__(
        self,
        heads: int,
        dim: int,
        group: int,
        device: torch.device,
        pin: bool = False,
        arena: DiskArena | None = None,
    ) -> None:
        """arena: hold codes and scales in the disk tier (mapped.py)."""
        from engine.memory.mapped import buffer  # mapped.py builds on buffers.py

        self.group, self.dim = group, dim
        self.codes = buffer(heads, dim, torch.uint8, device, pin, arena)
        # per group: keys (heads, blocks, 2 * dim) [scale | zero]; values (heads, n, 2)
        self.params = buffer(heads, 2 * dim if group else 2, HELD, device, pin, arena)

    @property
    def size(self) -> int:
        return self.codes.size

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def on_disk(self) -> bool:
        return self.codes.on_disk

    def spill(self, arena: DiskArena) -> bool:
        """Codes and scales to the disk tier (mapped.py); False when it is full."""
        from engine.memory.mapped import spilled

        for name in ("codes", "params"):
            moved = spilled(getattr(self, name), arena)
            if moved is None:
                return False
            setattr(self, name, moved)
        return True

    def append(self, x: torch.Tensor) -> None:  # x (heads, n, dim)
        heads, n, dim = x.shape
        if self.group:
            if n % self.group:
                raise ValueError(f"keys come in whole groups of {self.group} rows, not {n}")
            grouped = x.reshape(heads, n // self.group, self.group, dim)
            codes, scale, zero = quantize(grouped, dim=2)
            self.codes.append(codes.reshape(heads, n, dim))
            self.params.append(torch.cat((scale[:, :, 0], zero[:, :, 0]), dim=-1))
        else:
            codes, scale, zero = quantize(x, dim=-1)
            self.codes.append(codes)
            self.params.append(torch.cat((scale, zero), dim=-1))

    def reserve(self, n: int) -> None:
        self.codes.reserve(n)
        self.params.reserve(-(-n // self.group) if self.group else n)

    def drop_front(self, n: int) -> None:
        n = min(n, self.size)
        if self.group and n % self.group:
            raise ValueError(f"keys are dropped in whole groups of {self.group} rows, not {n}")
        self.codes.drop_front(n)
        self.params.drop_front(n // self.group if self.group else n)

    def take_to(self, idx: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Rows idx (heads, R) of each head, in range, widened -> (heads, R, dim) in dtype on
        device. Codes and scales cross to the device, not the widened rows (host tier)."""
        heads, R = idx.shape
        codes = self.codes.take(idx).to(device, non_blocking=True)
        g = self.group
        if g and R % g == 0 and _whole_groups(idx, g):  # one (scale, zero) row per group
            params = self.params.take(idx[:, ::g] // g).to(device, non_blocking=True)
            scale, zero = params[..., None, : self.dim], params[..., None, self.dim :]
            grouped = codes.view(heads, R // g, g, self.dim)
            return dequantize(grouped, scale, zero, dtype).view(heads, R, self.dim)
        params = self.params.take(idx // g if g else idx).to(device, non_blocking=True)
        if g:
            scale, zero = params[..., : self.dim], params[..., self.dim :]
        else:
            scale, zero = params[..., :1], params[..., 1:]
        return dequantize(codes, scale, zero, dtype)

    def view(self) -> torch.Tensor:
        """Every row held, widened to float32 (heads, n, dim): for checks, not decode steps."""
        idx = torch.arange(self.size, device=self.device).expand(self.codes.data.shape[0], -1)
        return self.take_to(idx, self.device, torch.float32)

    def to(self, device: torch.device, pin: bool = False) -> None:
        self.codes.to(device, pin)
        self.params.to(device, pin)

    def row_bytes(self) -> int:
        """Bytes one more row takes, its share of its group's scales included."""
        return self.codes.row_bytes() + self.params.row_bytes() // (self.group or 1)

    def nbytes(self) -> int:
        """Bytes of the codes and scales held."""
        return self.codes.nbytes() + self.params.nbytes()


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x -> (uint8 codes like x, scale, zero), scale and zero float16 with `dim` kept as 1:
    x ~ zero + codes * scale, off by at most scale / 2 (zero is rounded down and scale up to
    float16, so the group's range fits 0..255)."""
    x = x.float()
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    zero = rounded_outward(low, HELD, up=False)
    scale = rounded_outward((high - zero.float()) / LEVELS, HELD, up=True)
    step = torch.where(scale > 0, scale.float(), 1.0)  # a constant group: every code 0
    codes = ((x - zero.float()) / step).round_().clamp_(0, LEVELS).to(torch.uint8)
    return codes, scale, zero


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """zero + codes * scale, computed in float32 (scale and zero broadcast against codes)."""
    return torch.addcmul(zero.float(), codes.float(), scale.float()).to(dtype)


def rounded_outward(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """x in dtype, rounded up (or down) where it is not exact and clamped to finite values:
    a maximum held in float16 stays at or above the true one, a minimum at or below (up to the
    clamp, far beyond any key)."""
    if dtype == x.dtype:
        return x
    finite = torch.finfo(dtype).max
    held = x.clamp(-finite, finite).to(dtype)
    off = held.to(x.dtype) < x if up else held.to(x.dtype) > x
    toward = torch.full_like(held, finite if up else -finite)
    return torch.where(off, torch.nextafter(held, toward), held)


def _whole_groups(idx: torch.Tensor, group: int) -> bool:
    """Whether rows idx (heads, R) are whole groups: each run of `group` starts at a multiple
    of it and counts up by one."""
    runs = idx.view(idx.shape[0], -1, group)
    first = runs[..., :1]
    offsets = torch.arange(group, device=idx.device)
    return bool(((first % group == 0) & (runs - first == offsets)).all())


def memory_buffers(
    setting: str,
    heads: int,
    dim: int,
    block: int,
    model_dtype: torch.dtype,
    device: torch.device,
    pin: bool,
    arena: DiskArena | None = None,
) -> tuple[GrowingBuffer | QuantizedBuffer, GrowingBuffer | QuantizedBuffer]:
    """One layer's memory keys and values as FrameConfig.memory_dtype holds them: "int8"
    quantized (keys per channel over each block, values per token), else in storage_dtype;
    in the disk tier when arena is given (mapped.py)."""
    from engine.memory.mapped import buffer

    if setting == "int8":
        return QuantizedBuffer(heads, dim, block, device, pin, arena), QuantizedBuffer(
            heads, dim, 0, device, pin, arena
        )
    held = storage_dtype(setting, model_dtype)
    return (
        buffer(heads, dim, held, device, pin, arena),
        buffer(heads, dim, held, device, pin, arena),
    )
