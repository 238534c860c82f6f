"""A memory's one-token append as a row of a batched decode forward (engine/runner/rows.py):
what `SessionMemory.decode_row` hands the batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.memory.frame import Frame
    from engine.memory.session import SessionMemory


class MemoryRow:
    """A memory's one-token append, as a row of a batched decode forward (engine/runner/rows.py)."""

    def __init__(self, memory: SessionMemory, token_id: int) -> None:
        self._memory = memory
        self._ids = torch.tensor([token_id], dtype=torch.long)
        self.attend = memory._frame.attend  # a layer's attention of the row: its frame's

    @property
    def frame(self) -> Frame:
        return self._memory._frame

    def begin(self) -> int:
        memory = self._memory
        memory.reload()
        assert not memory._selector.wants_vote(1), "a decode step never votes"
        return int(memory._begin_forward(1)[0])

    def commit(self, logits: torch.Tensor) -> None:
        self._memory._commit(self._ids)
        self._memory._last_logits = logits

    def abort(self) -> None:
        self._memory._frame.abort()
