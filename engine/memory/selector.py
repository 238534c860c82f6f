"""What a strategy plugs into the frame: the `Selector` base class.

A strategy (segments.py, tokens.py, neurocache.py) subclasses `Selector` and overrides
`select`; the frame and the session call every other hook unconditionally, and the defaults here
do nothing, so a strategy overrides only the hooks it needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.memory.buffers import LayerStore

if TYPE_CHECKING:
    from engine.memory.frame_state import FrameState


class Selector:
    """Picks the memory rows a chunk attends to, and follows what the frame does with memory."""

    # the frame this selector serves, set by the session (and cleared when the session goes)
    frame: FrameState | None = None

    def select(
        self, layer: int, q_pre: torch.Tensor, store: LayerStore, scaling: float
    ) -> torch.Tensor | None:
        """q_pre (kv_heads, group, T, head_dim) pre-rotary queries of the chunk -> memory
        indices (kv_heads, R) ascending per head, -1 for padding; None for nothing."""
        raise NotImplementedError

    def on_memory_added(self, layer: int, k_pre: torch.Tensor, v: torch.Tensor) -> None:
        """Whole blocks (kv_heads, n * block, head_dim) joined the end of this layer's memory,
        oldest first (views valid during the call only: copy what you keep)."""

    def on_memory_dropped(self, layer: int, n: int) -> None:
        """The n oldest memory tokens of this layer were dropped (FIFO)."""

    def mark_state(self) -> Any:
        """What `on_rewind` needs to restore the selector's state beside memory (Frame.mark)."""
        return None

    def on_rewind(self, n_local: int, state: Any) -> None:
        """The frame forgot its newest tokens (Frame.rewind): memory is as it was, the
        window holds its n_local oldest tokens; `state` is what mark_state gave then."""

    def on_commit(self, num_new: int, to_sinks: int) -> None:
        """A forwarded chunk of num_new tokens (the first to_sinks of them sinks) is about to
        join the frame."""

    def on_abort(self) -> None:
        """The forward under way failed or was thrown away (a voting pass)."""

    def to(self, device: torch.device) -> None:
        """Move what the selector keeps to device (the frame moves with it)."""

    def nbytes(self) -> int:
        """Bytes of what the selector keeps beside the frame's keys and values."""
        return 0

    def pop_seconds(self) -> float:
        """Retrieval time spent outside `select` since the last call."""
        return 0.0

    def export_chunk_state(self, precise: bool = False) -> dict[str, Any]:
        """JSON-able state it keeps from the forwarded chunk beyond its keys and values
        (precise: as held, not rounded to fp16 for the store's shared chunks)."""
        return {}

    def import_chunk_state(self, state: dict[str, Any], forwarded: bool) -> None:
        """Take back what `export_chunk_state` gave, before commit (forwarded: the chunk was
        just forwarded, so only replace what the forward computed)."""

    def wants_vote(self, num_tokens: int) -> bool:
        """Whether a forward of num_tokens runs twice: a voting pass first (aborted), then
        `hold_vote()`, then the real forward."""
        return False

    def hold_vote(self) -> None:
        """The voting pass just finished (see wants_vote)."""
