"""Where the frame's keys and values live: growing buffers, and one layer's store of them.

`GrowingBuffer` holds (heads, n, dim) rows with amortised O(1) appends and O(1) front drops;
`LayerStore` is one layer's sinks, local window and memory (engine/memory/frame.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.memory.quantized import QuantizedBuffer


class GrowingBuffer:
    """(heads, n, dim) with amortised O(1) appends along n and O(1) drops from the front.

    Rows live in data[:, start : start + size]; an append that does not fit moves the live
    rows to the front when that frees at least half the capacity, else doubles it, so each row
    is copied a constant number of times on average (a sliding local window is not re-copied
    whole on every commit).

    pin: keep the data in page-locked host memory (a host tier feeding a CUDA device), so
    copies of retrieved rows to the device can run asynchronously.

    A copy (`__deepcopy__`, a session's fork) shares the data until a write would touch rows
    another live holder still views: that writer then takes its own copy first. So a fork
    costs no copy of memory, and appends past every holder's rows stay in place."""

    quantized = False  # as QuantizedBuffer (quantized.py), which memory blocks may be instead
    _share: _Share | None = None  # the holders of this data, once copied

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

    on_disk = False  # as MappedBuffer (mapped.py, the disk tier) while its rows are there

    def append(self, x: torch.Tensor) -> None:  # x (heads, n, dim)
        share = self._share
        if share is None:
            self._append(x)
            return
        with share.lock:  # a check and its write, whole, against the other holders'
            self._append(x)

    def _append(self, x: torch.Tensor) -> None:
        n = x.shape[1]
        capacity = self.data.shape[1]
        end = self.start + self.size
        share = self._share
        if end + n > capacity:
            self._make_room(n)
        elif share is not None and end < share.frontier and self._others_view(end, end + n):
            self._grow(capacity)  # rows another holder reads: this buffer's own copy first
        end = self.start + self.size
        self.data[:, end : end + n] = x.to(self.data.device)
        self.size += n
        if self._share is not None:  # rows past the frontier are no holder's yet
            self._share.frontier = max(self._share.frontier, end + n)

    def reserve(self, n: int) -> None:
        """Room for n more rows in one allocation (a document of known length): no doubling
        steps, each holding the old rows and twice as many new ones, on the way there."""
        if self.start + self.size + n > self.data.shape[1]:
            self._grow(self.size + n)

    def _make_room(self, n: int) -> None:
        """Room for n more rows after the live ones."""
        capacity = self.data.shape[1]
        if self.size + n > capacity // 2:
            self._grow(max(2 * capacity, self.size + n, 256))
        elif self._others_view(0, self.size + n):
            self._grow(capacity)  # the moved rows and the new ones would cover another's
        else:
            self._to_front()

    def _grow(self, capacity: int) -> None:
        """Room for `capacity` rows, the live rows moved to the front."""
        grown = self.data.new_empty(self.data.shape[0], capacity, self.data.shape[2])
        if self.pin:
            grown = grown.pin_memory()
        grown[:, : self.size] = self.view()
        self.data, self.start = grown, 0
        self._leave_share()

    def _others_view(self, first: int, end: int) -> bool:
        """Whether another live holder of this data views any of its rows [first, end)."""
        share = self._share
        if share is None:
            return False
        others = [b for b in share.holders if b is not self]
        if not others:
            self._share = None  # every copy is gone: the data is this buffer's alone
            return False
        return any(b.start < end and first < b.start + b.size for b in others)

    def _leave_share(self) -> None:
        """This buffer moved to data of its own."""
        if self._share is not None:
            self._share.holders.discard(self)
            self._share = None

    def _to_front(self) -> None:
        """Move the live rows to the front, in pieces no longer than the gap they close (a
        piece never overlaps its own source, and no copy of them all is made)."""
        step = max(min(self.start, 4096), 1)
        for i in range(0, self.size, step):
            n = min(step, self.size - i)
            self.data[:, i : i + n] = self.data[:, self.start + i : self.start + i + n]
        self.start = 0

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device, pin: bool = False) -> None:
        """Move the held rows (only those: spare capacity is dropped) to device."""
        data = self.view().to(device).contiguous()  # take() reads the buffer as flat rows
        self.pin = pin and device.type == "cpu" and torch.cuda.is_available()
        self.data = data.pin_memory() if self.pin else data.clone()
        self.start = 0
        self._leave_share()

    def __deepcopy__(self, memo: dict[int, object]) -> GrowingBuffer:
        """A copy (SessionMemory.fork) sharing this buffer's data: rows are copied only when
        a write would touch rows the other still views (append, _make_room). Inside
        `private_copies`, a copy of its own rows with the same room after them."""
        if _private.get():
            own = GrowingBuffer.__new__(GrowingBuffer)
            own.pin, own.start, own.size = self.pin, 0, self.size
            own.data = self.data[:, self.start :].clone(memory_format=torch.contiguous_format)
            own.data = own.data.pin_memory() if self.pin else own.data
            memo[id(self)] = own
            return own
        copy = GrowingBuffer.__new__(GrowingBuffer)
        copy.pin, copy.start, copy.size, copy.data = self.pin, self.start, self.size, self.data
        share = self._share = self._share or _Share(self)
        with share.lock:
            share.holders.add(copy)
        copy._share = share
        memo[id(self)] = copy
        return copy

    def drop_front(self, n: int) -> None:
        n = min(n, self.size)
        self.start += n
        self.size -= n

    def drop_back(self, n: int) -> None:
        """Forget the n newest rows (a rewind)."""
        self.size -= min(n, self.size)

    def view(self) -> torch.Tensor:
        return self.data[:, self.start : self.start + self.size]

    def take(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows idx (heads, R) of each head, in range -> (heads, R, dim). One index_select of
        whole rows over the flat buffer: a row is one copy, where `gather` along the rows
        reads element by element (docs/decisions/017-frame-copies-and-masks.md)."""
        heads, capacity, dim = self.data.shape
        stride = self.data.stride(0) // dim  # rows between heads: capacity, or the disk tier's
        offsets = torch.arange(heads, device=idx.device)[:, None] * stride + self.start
        rows = (idx + offsets).reshape(-1)
        flat = self.data.as_strided(((heads - 1) * stride + capacity, dim), (dim, 1))
        return flat.index_select(0, rows).view(heads, -1, dim)

    def take_to(self, idx: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """take(idx) in dtype on device (QuantizedBuffer.take_to's contract)."""
        return self.take(idx).to(device, dtype, non_blocking=True)

    def row_bytes(self) -> int:
        """Bytes one more row takes (every head)."""
        return self.data.shape[0] * self.data.shape[2] * self.data.element_size()

    def nbytes(self) -> int:
        """Bytes of the rows held (the capacity behind them, grown by doubling, is up to twice
        that while a session grows)."""
        return self.size * self.data.shape[0] * self.data.shape[2] * self.data.element_size()


_private: contextvars.ContextVar[bool] = contextvars.ContextVar("private_copies", default=False)


@contextlib.contextmanager
def private_copies(private: bool = True) -> Iterator[None]:
    """Buffers copied inside the block (a fork) get rows of their own, not shared ones (unless
    `private` is False): what a bench of distinct sessions' frames needs (bench/memory_batch.py)."""
    token = _private.set(private)
    try:
        yield
    finally:
        _private.reset(token)


class _Share:
    """The buffers holding one data tensor since a copy (weakly: a dropped fork leaves by
    itself), the lock their writes take, and the first row none of them has reached."""

    __slots__ = ("frontier", "holders", "lock")

    def __init__(self, first: GrowingBuffer) -> None:
        self.holders: weakref.WeakSet[GrowingBuffer] = weakref.WeakSet([first])
        self.lock = threading.Lock()
        # no holder views or has written a row at or past this one: appends there need no check
        self.frontier = first.start + first.size


@dataclass
class LayerStore:
    """One layer's pre-rotary keys and values, each (kv_heads, n, head_dim): sinks (fixed once
    filled), the local window and memory (growing buffers; memory's quantized under
    memory_dtype "int8")."""

    sink_k: torch.Tensor
    sink_v: torch.Tensor
    window_k: GrowingBuffer
    window_v: GrowingBuffer
    mem_k: GrowingBuffer | QuantizedBuffer
    mem_v: GrowingBuffer | QuantizedBuffer

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


def storage_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """What memory blocks hold keys and values in (FrameConfig.memory_dtype), and segments'
    summaries; under "int8" (quantized.py) the summaries are held as under "auto"."""
    auto = setting in ("auto", "int8")
    if setting == "float16" or (auto and model_dtype == torch.float32):
        return torch.float16
    return model_dtype
