"""A question on memory answered over its frame read afresh (memory knob answer_read "afresh").

The session reads the question as always: its tail retrieves (the strategy's blocks and the
text prior's), and memory keeps every token. Then the frame's tokens (sinks, the retrieved
rows, the window with the question) are read again by the model's own attention into a plain
KV cache, and the answer is generated there. The same tokens through their stored keys and
values (each block's read in its own place in the document, none of them seeing the others)
answered far worse than read afresh (docs/decisions/076-answer-read-afresh.md). The answer's
tokens join the session's memory when the request ends (`flush`), one forward.

With the memory knob `contrast` (CAD's alpha, engine/runner/contrast.py) above 0, a second
plain cache reads the same request without what retrieval and the window brought (the sinks and
the request's own tokens after any inline document, at most local_window of a call), and each
next token is scored by how much the frame raises it.
With `copy_numbers`, long digit runs of the answer copy numbers the frame holds
(`number_copy`, engine/runner/copy_numbers.py).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.runner.contrast import PairedRow, contrast
from engine.runner.copy_numbers import NumberCopy
from engine.runner.decode_state import KVCacheState, decode_batch
from engine.runner.rows import DecodeRow
from engine.sessions.memory_state import MemoryState


class FrameTextState:
    """A MemoryState whose answer runs on a plain cache of the question's frame tokens."""

    def __init__(
        self, inner: MemoryState, model: Any, kv_dtype: str, digits: tuple[int, ...] | None = None
    ) -> None:
        self.inner = inner
        self.strategy = inner.strategy
        self._model, self._kv_dtype = model, kv_dtype
        self._kv: KVCacheState | None = None  # the frame read afresh, once a forward retrieved
        self._bare: KVCacheState | None = None  # the request without its frame (contrast > 0)
        self._alpha = inner.memory.config.contrast
        self._bare_logits: torch.Tensor | None = None  # the bare row's, at its last token
        self._base = 0  # tokens of the frame in _kv; later ones are the answer's
        self._offered: list[int] = []  # tokens stepped on _kv, the session's memory still owes
        self._digits = digits  # the tokenizer's digit tokens (copy_numbers)
        self.number_copy: NumberCopy | None = None  # the answer's digit runs, once a frame is read

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens + len(self._owed())

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        document = self.inner.document_left  # this call's first tokens may end a document
        if self._kv is not None:  # more prompt after the answer began: every cache reads it
            self.flush()
            self.inner.prefill(input_ids)
            return self._contrasted(self._kv.prefill(input_ids), input_ids, document)
        memory = self.inner.memory
        memory.forget_selection()
        logits = self.inner.prefill(input_ids)
        ids = memory.frame_ids()
        if ids is None:  # nothing retrieved (the session fits, or a document chunk)
            return logits
        self._kv = KVCacheState(self._model, kv_dtype=self._kv_dtype)
        logits = self._kv.prefill(torch.tensor(ids, dtype=torch.long))
        self._base = self._kv.num_tokens
        least = memory.config.copy_numbers
        if least and self._digits is not None:
            self.number_copy = NumberCopy(self._digits, ids, least)
        # the bare request: the sinks (system prompt, the session's start), then the request's
        # tokens from this call on that are not an inline document's, however prefill cut them
        # (a reused prefix moves the cuts). A frame that retrieved has memory past its sinks.
        if self._alpha > 0:
            sinks = torch.tensor(ids[: memory.config.sinks], dtype=torch.long)
            self._bare = KVCacheState(self._model, kv_dtype=self._kv_dtype)
            self._bare_logits = self._bare.prefill(sinks)
        return self._contrasted(logits, input_ids, document)

    def step(self, token_id: int) -> torch.Tensor:
        if self._bare is not None:  # both rows in one forward, as a batch would run them
            return decode_batch(self._model, [self], [token_id])[0]
        if self._kv is None:
            return self.inner.step(token_id)
        self._offer(token_id)
        return self._kv.step(token_id)

    def decode_row(self, token_id: int) -> DecodeRow | PairedRow:
        if self._kv is None:
            return self.inner.decode_row(token_id)
        self._offer(token_id)
        if self._bare is not None:
            return PairedRow(
                self._kv.decode_row(token_id), self._bare.decode_row(token_id), self._alpha
            )
        return self._kv.decode_row(token_id)

    def _contrasted(self, logits: torch.Tensor, input_ids: torch.Tensor, skip: int) -> torch.Tensor:
        """logits with the frame, contrasted with the bare cache once it has read input_ids past
        their first `skip` (an inline document's)."""
        if self._bare is None:
            return logits
        # no more of a long call than the frame's window holds: the bare row stays small
        ids = input_ids.reshape(-1)[skip:][-self.inner.memory.config.local_window :]
        if ids.numel():
            self._bare_logits = self._bare.prefill(ids)
        assert self._bare_logits is not None
        return contrast(logits, self._bare_logits, self._alpha)

    def pop_retrieval_seconds(self) -> float:
        return self.inner.pop_retrieval_seconds()

    def flush(self) -> None:
        """The answer's tokens so far join the session's memory (the request ends)."""
        owed = self._owed()
        self._offered = []
        if self._kv is not None:
            self._base = self._kv.num_tokens
        if owed:
            self.inner.prefill(torch.tensor(owed, dtype=torch.long))

    def _owed(self) -> list[int]:
        """The offered tokens the plain cache took (a failed step's token is not among them)."""
        if self._kv is None:
            return []
        return self._offered[: self._kv.num_tokens - self._base]

    def _offer(self, token_id: int) -> None:
        self._offered = [*self._owed(), token_id]


def answering(
    state: MemoryState, model: Any, kv_dtype: str, digits: tuple[int, ...] | None = None
) -> MemoryState | FrameTextState:
    """The state a request's answer runs on: its memory's, or (answer_read "afresh") this.
    digits: the tokenizer's digit tokens, for the knob copy_numbers."""
    if state.memory.config.answer_read != "afresh":
        return state
    return FrameTextState(state, model, kv_dtype, digits)
