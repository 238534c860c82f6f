"""Memory blocks' disk tier: buffers backed by files, so a long session's blocks stay on disk.

A `DiskArena` hands out `Region`s: one growing buffer's (heads, rows, dim) storage, a shared
mapping of a sparse file in one directory (the server's setting, never a client's). Each
head's rows start `max_rows` rows apart, so the buffer grows in place (no copy, no new file)
up to max_rows, and rows never written take no disk. The file is unlinked as soon as it is
mapped: nothing is left behind when the server stops or dies, and its space returns when the
region is freed. Pages a decode step reads come through the page cache, which the kernel
keeps as an LRU and reclaims under pressure; none of it is the process's anonymous memory.
The mapping is advised random: the kernel's readahead around each fault, into a file that is
mostly holes, made writes 3-7× slower and retrieval's cold reads slower too (decision 102).
`budget` bounds the bytes the regions' rows in use span, over every session. Why, and what
it costs: docs/decisions/077-memory-on-disk.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import tempfile
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from engine.memory.buffers import GrowingBuffer, LayerStore

if TYPE_CHECKING:
    from engine.config import EngineConfig


class DiskArena:
    """File-backed regions in `directory`, at most `budget` bytes of rows in use over all of
    them; a region holds at most `max_rows` rows per head."""

    def __init__(self, directory: str, budget: int, max_rows: int) -> None:
        if budget < 0 or max_rows < 1:
            raise ValueError("the disk tier needs budget >= 0 bytes and max_rows >= 1")
        os.makedirs(directory, exist_ok=True)
        self.directory, self.budget, self.max_rows = directory, budget, max_rows
        self._used = 0
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, object]) -> DiskArena:
        return self  # one per server: a forked session's copies share it (and its budget)

    @property
    def used(self) -> int:
        """Bytes of the rows the live regions have taken (the files are sparse beyond them)."""
        return self._used

    def region(self, heads: int, dim: int, dtype: torch.dtype) -> Region:
        """An empty region for (heads, rows, dim) rows of dtype, rows growing to max_rows."""
        return Region(self, heads, dim, dtype)

    def _take(self, nbytes: int) -> bool:
        with self._lock:
            if self._used + nbytes > self.budget:
                return False
            self._used += nbytes
            return True

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes


class Region:
    """One buffer's storage in the arena: `data()` is the (heads, capacity, dim) view of the
    rows taken so far (its head stride is max_rows rows); `grow(capacity)` takes more from the
    budget, in place."""

    def __init__(self, arena: DiskArena, heads: int, dim: int, dtype: torch.dtype) -> None:
        self.arena, self.rows = arena, arena.max_rows
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.row_bytes = heads * dim * itemsize
        numel = heads * self.rows * dim
        fd, path = tempfile.mkstemp(prefix="longserve-blocks-", dir=arena.directory)
        try:
            os.ftruncate(fd, numel * itemsize)  # sparse: no disk until rows are written
            flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        finally:
            os.unlink(path)
            os.close(fd)
        _advise_random(flat)
        self.storage = flat.view(heads, self.rows, dim)
        self.capacity = 0
        self._taken = [0]  # bytes taken from the budget, returned when the storage is freed
        weakref.finalize(self.storage, _give_back, arena, self._taken)

    def grow(self, capacity: int) -> bool:
        """Take rows up to `capacity` (at most max_rows) per head; False, taking nothing, when
        that passes max_rows or the arena's budget."""
        if capacity <= self.capacity:
            return True
        if capacity > self.rows or not self.arena._take(
            (capacity - self.capacity) * self.row_bytes
        ):
            return False
        self._taken[0] += (capacity - self.capacity) * self.row_bytes
        self.capacity = capacity
        return True

    def data(self) -> torch.Tensor:
        return self.storage[:, : self.capacity]


_MADV_RANDOM = 1  # Linux's: no readahead on faults in the range
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if os.name == "posix" else None


def _advise_random(mapped: torch.Tensor) -> None:
    """Ask the kernel for no readahead on this whole mapping (a hint: nothing if refused)."""
    if _libc is None or not mapped.numel():
        return
    start = mapped.data_ptr()
    page = os.sysconf("SC_PAGE_SIZE")
    base = start - start % page
    length = start - base + mapped.numel() * mapped.element_size()
    _libc.madvise(ctypes.c_void_p(base), ctypes.c_size_t(length), _MADV_RANDOM)


def _give_back(arena: DiskArena, taken: list[int]) -> None:
    arena._release(taken[0])


class MappedBuffer(GrowingBuffer):
    """A GrowingBuffer whose rows live in a Region of the disk tier. It grows in place, by a
    quarter at a time (no row is copied to grow); when the region cannot grow (max_rows, or
    the tier is full) it moves to RAM and goes on as a plain GrowingBuffer would, so a commit
    never fails half-way."""

    def __init__(self, region: Region) -> None:
        self.region: Region | None = region
        self.data = region.data()
        self.start = self.size = 0
        self.pin = False

    @property
    def on_disk(self) -> bool:  # type: ignore[override]
        return self.region is not None

    def _make_room(self, n: int) -> None:
        region = self.region
        if region is None:
            super()._make_room(n)
            return
        capacity = self.data.shape[1]
        if self.start + self.size + n > region.rows:
            self._to_front()  # a FIFO memory that went round its region
        need = self.start + self.size + n
        if region.grow(min(max(need, capacity * 5 // 4, 256), region.rows)) or region.grow(need):
            self.data = region.data()
            return
        self.region = None  # the tier is full: RAM from here on
        self._grow(max(2 * capacity, self.size + n, 256))

    def reserve(self, n: int) -> None:
        """Nothing: a region grows in place, without a copy."""
        if self.region is None:
            super().reserve(n)

    def to(self, device: torch.device, pin: bool = False) -> None:
        """Rows on disk stay there for the CPU (the tier is CPU storage); another device
        takes a plain copy."""
        if self.region is not None and device.type == "cpu":
            return
        self.region = None
        super().to(device, pin)

    def __deepcopy__(self, memo: dict[int, object]) -> GrowingBuffer:
        """A copy on disk (in RAM when the tier is full) of the held rows only."""
        copy: GrowingBuffer | None = None
        if self.region is not None:
            copy = copied(self, self.region.arena)
        if copy is None:
            copy = GrowingBuffer.__deepcopy__(self, memo)
        memo[id(self)] = copy
        return copy


def buffer(
    heads: int,
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
    pin: bool = False,
    arena: DiskArena | None = None,
) -> GrowingBuffer:
    """An empty growing buffer: in arena (the disk tier) when given and on the CPU."""
    if arena is not None and device.type == "cpu":
        return MappedBuffer(arena.region(heads, dim, dtype))
    return GrowingBuffer(heads, dim, dtype, device, pin)


def spilled(rows: GrowingBuffer, arena: DiskArena) -> GrowingBuffer | None:
    """rows in the disk tier: rows itself when they are there already, else a copy (None
    when the arena cannot take them or rows are not on the CPU)."""
    return rows if rows.on_disk else copied(rows, arena)


def copied(rows: GrowingBuffer, arena: DiskArena) -> MappedBuffer | None:
    """A MappedBuffer holding a copy of rows' live rows; None when the arena cannot take
    them or rows are not on the CPU."""
    if rows.device.type != "cpu":
        return None
    heads, _, dim = rows.data.shape
    region = arena.region(heads, dim, rows.data.dtype)
    if not region.grow(max(rows.size, 1)):
        return None
    moved = MappedBuffer(region)
    moved.data = region.data()
    moved.data[:, : rows.size] = rows.view()
    moved.size = rows.size
    return moved


def spill_store(store: LayerStore, arena: DiskArena) -> bool:
    """Move one layer's memory blocks to the disk tier; False when it is full (a buffer
    moved before that stays moved: it reads the same)."""
    for name in ("mem_k", "mem_v"):
        rows = getattr(store, name)
        if rows.quantized:  # QuantizedBuffer: its codes and scales
            if not rows.spill(arena):
                return False
            continue
        moved = spilled(rows, arena)
        if moved is None:
            return False
        setattr(store, name, moved)
    return True


def disk_arena(config: EngineConfig) -> DiskArena | None:
    """The engine's disk tier: memory_disk_dir, else DATA_DIR/blocks, else the system's
    temporary directory; None when memory_disk_bytes is 0."""
    if not config.memory_disk_bytes:
        return None
    directory = config.memory_disk_dir
    if directory is None and config.data_dir is not None:
        directory = os.path.join(config.data_dir, "blocks")
    if directory is None:
        directory = os.path.join(tempfile.gettempdir(), "longserve-blocks")
    return DiskArena(directory, config.memory_disk_bytes, config.max_memory_tokens)
