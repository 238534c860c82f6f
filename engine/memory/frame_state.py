"""What a frame holds (FrameState): the stores of every layer, its counts, and the positions
of the chunk being forwarded; where it stood (FrameMark). frame.py's `Frame` attends and commits;
the helpers that attend parts of it (band.py, chunk.py, step_cache.py, prior.py, tokens.py) read
this state, so none of them imports frame.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.memory.buffers import GrowingBuffer, LayerStore
from engine.memory.config import FrameConfig
from engine.memory.mapped import spill_store
from engine.memory.quantized import memory_buffers
from engine.memory.rotary import Angles, RotaryTable

if TYPE_CHECKING:
    from engine.memory.mapped import DiskArena


@dataclass(frozen=True)
class FrameMark:
    """Where a frame stood (Frame.mark): what `rewind` takes it back to."""

    num_tokens: int
    n_sinks: int
    n_local: int
    moved: int  # tokens ever moved to memory
    selector: Any  # Selector.mark_state()


@dataclass
class PendingChunk:
    k_pre: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    k_window: dict[int, torch.Tensor] = field(default_factory=dict)  # StepQueries.k_window


class FrameState:
    """What a frame holds: the stores of every layer, its counts and positions, and the chunk
    being forwarded. The helpers that attend parts of a frame read it; `Frame` (frame.py)
    changes it."""

    def __init__(
        self,
        config: FrameConfig,
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
        """arena: the server's disk tier; memory blocks are held there from the start under
        tier "disk", and move there (`spill`) once they pass spill_bytes (0: never)."""
        self.config = config
        self.rotary = rotary
        self.kv_heads = kv_heads
        self.arena = arena
        self.spill_bytes = spill_bytes
        self._spilled = config.tier == "disk"
        self._spill_failed_at = 0  # memory_nbytes when the disk tier last could not take them
        # sinks and window hold keys and values in window_dtype (the engine's kv_dtype: float16
        # under int4 weights, as plain KV caches), else in the model's dtype
        self.window_dtype = window_dtype or dtype
        empty = torch.empty(kv_heads, 0, head_dim, dtype=self.window_dtype, device=device)
        host = config.tier == "host"
        on_disk = config.tier == "disk"
        if on_disk and arena is None:
            raise ValueError('tier "disk" needs the server\'s disk tier (an arena)')
        memory_device = torch.device("cpu") if host or on_disk else device
        # the CPU memory-step kernels serve float32 models (sinks, window and memory in float32
        # or float16); a bfloat16 model's lean step has float32 queries, but its steps take
        # torch's ops (RowReader gathers under the same rule)
        self.held_for_kernels = dtype == torch.float32
        self.layers = [
            LayerStore(
                empty,
                empty,
                GrowingBuffer(kv_heads, head_dim, self.window_dtype, device),
                GrowingBuffer(kv_heads, head_dim, self.window_dtype, device),
                *memory_buffers(
                    config.memory_dtype,
                    kv_heads,
                    head_dim,
                    config.block,
                    dtype,
                    memory_device,
                    host,
                    arena if on_disk else None,
                ),
            )
            for _ in range(num_layers)
        ]
        self.n_sinks = 0
        self.n_local = 0
        self.n_memory = 0  # tokens in memory now
        self.moved = 0  # tokens ever moved from the window to memory
        self.memory_used = False  # memory has ever held a token: positions are budgets from now
        self.num_tokens = 0
        self.retrieval_seconds = 0.0
        self.last_selected: dict[int, torch.Tensor] = {}  # layer -> (kv_heads, R), for tests
        self.pinned: torch.Tensor | None = None  # memory rows (P,) every retrieval includes
        self._positions: torch.Tensor | None = None
        self._pending = PendingChunk()
        self.mask_cache: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        # fixed by begin() for all layers of a forward: the rotary angles of the chunk and of
        # the window tokens it attends, and how many of the oldest window tokens it skips
        self._chunk_angles: Angles | None = None
        self._window_angles: Angles | None = None
        self._window_skip = 0
        self._sinks_rotated: dict[int, torch.Tensor] = {}
        self._device, self._dtype = device, dtype
        # memory keys are stored rotated by their offset in their block (block-local), so a
        # decode step that retrieves whole blocks rotates its query once per block instead of
        # every retrieved key (StepCache.attend); composing rotations needs unscaled ones
        self.block_local = rotary.scale_sq == 1.0

    @property
    def device(self) -> torch.device:
        return self._device

    # -- the disk tier -----------------------------------------------------------------------

    @property
    def on_disk(self) -> bool:
        """Whether any memory blocks are held in the disk tier (tier "disk", or spilled)."""
        return any(s.mem_k.on_disk or s.mem_v.on_disk for s in self.layers)

    def memory_row_bytes(self) -> int:
        """Bytes one more token takes in memory blocks, over every layer."""
        return sum(s.mem_k.row_bytes() + s.mem_v.row_bytes() for s in self.layers)

    def memory_nbytes(self) -> int:
        """Bytes of the memory blocks' keys and values, in whatever tier they are."""
        return sum(s.mem_k.nbytes() + s.mem_v.nbytes() for s in self.layers)

    def spill(self) -> bool:
        """Move every layer's memory blocks to the disk tier. False when it is full: the
        layers moved before that stay moved (they read the same), the rest stay in RAM."""
        if self.arena is None:
            return False
        return all(spill_store(store, self.arena) for store in self.layers)

    def reserve(self, n: int) -> None:
        """Room for n more tokens in every layer's memory blocks, taken at once. Blocks that
        would pass spill_bytes go to the disk tier now instead, where they grow in place."""
        if self.config.m:  # a FIFO memory holds at most m
            n = min(n, self.config.m - self.n_memory)
        if n <= 0:
            return
        self.spill_if_over(coming=n * self.memory_row_bytes())
        for store in self.layers:
            store.mem_k.reserve(n)
            store.mem_v.reserve(n)

    def spill_if_over(self, coming: int = 0) -> None:
        """Spill once the memory blocks (with `coming` bytes about to be added) pass
        spill_bytes: a session past its fast tier's budget moves to the disk tier instead of
        failing (and stays in RAM, growing up to max_memory_tokens, while the tier is full)."""
        if self.arena is None or not self.spill_bytes or self._spilled:
            return
        held = self.memory_nbytes() + coming
        # after a failed try, wait for a quarter more blocks: each try copies layers
        if held > max(self.spill_bytes, self._spill_failed_at * 5 // 4):
            self._spilled = self.spill()
            self._spill_failed_at = 0 if self._spilled else held

    # -- positions ---------------------------------------------------------------------------

    def query_at_retrieval_distance(self, q_pre: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """q_pre (..., len(rows), d), pre-rotary queries of the chunk's tokens `rows`, rotated by
        their distance to the middle of the retrieved span: their inner product with a
        pre-rotary key is then the attention logit that key would get once retrieved (rotary
        attention depends only on q, k and their distance). Searching pre-rotary keys with
        pre-rotary queries instead scores every key as if it sat at the query's own position,
        where the high-frequency dimensions count fully; retrieved keys sit a window away
        (docs/decisions/016-tokens-search.md)."""
        assert self._positions is not None, "Frame.begin() was not called"
        middle = self.config.sinks + self.config.retrieval_budget // 2
        distance = (self._positions[rows] - middle).clamp(min=0)
        return self.rotary.rotate(q_pre, distance)

    def step_retrieval_distance(self) -> int:
        """query_at_retrieval_distance's distance for a one-token forward, as an int."""
        assert self._positions is not None and self._positions.numel() == 1, "one token"
        middle = self.config.sinks + self.config.retrieval_budget // 2
        return max(int(self._positions[0]) - middle, 0)

    def _window_end(self) -> int:
        """The frame position right after the local window: where the next chunk starts."""
        c = self.config
        before = c.sinks + c.retrieval_budget if self.memory_used else self.n_sinks
        return before + self.n_local

    def _local_positions(self) -> torch.Tensor:
        end = self._window_end()
        return torch.arange(end - self.n_local, end, device=self._device)

    def rotated_sinks(self, layer: int) -> torch.Tensor:
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
