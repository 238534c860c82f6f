"""The decode state of a request on memory: a session's, or a long prompt's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine.runner.rows import DecodeRow

if TYPE_CHECKING:
    from engine.caches.prefix_store import ChunkWriter


class MemoryState:
    """A session's memory: every token appended (prompt and generated) joins its context.

    document_end: the prompt's first document_end tokens are a document (an inline prompt's
    body, everything before its question's tail): it is read in whole chunks, as a session
    reads an uploaded document, and once read it moves to memory (SessionMemory.end_document),
    so the question reaches it through retrieval. read: tokens of the prompt the memory holds
    already (a reused prefix; engine/caches/prefix_cache.py); prefill gets the rest. keep: (point,
    callback) calls callback(memory) once the document has been read up to point. write:
    (unit, writer) reads the document with write-through (engine/caches/prefix_store.py), one
    `unit`-token forward at a time, calls writer(chain hash, encoding) for each whole one, and
    writer.flush() once the document is read: its chunks are stored before the question is."""

    def __init__(
        self,
        memory: Any,
        strategy: str | None,
        document_end: int | None = None,
        *,
        read: int = 0,
        keep: tuple[int, Callable[[Any], None]] | None = None,
        write: tuple[int, ChunkWriter] | None = None,
    ) -> None:
        self.memory = memory  # engine.memory.session.SessionMemory
        self.strategy = strategy
        self._document_end = document_end
        self._read = read
        self._reserve = max((document_end or 0) - read, 0)  # taken at the first read
        self._keep = keep
        self._write = write

    @property
    def num_tokens(self) -> int:
        return int(self.memory.num_tokens)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.to(torch.long).view(-1)  # (T,) -> (vocab,)
        end, start = self._document_end, self._read
        self._read += ids.numel()
        if end is None or start >= end:
            return self.memory.append(ids)
        if self._reserve:
            self.memory.reserve(self._reserve)
            self._reserve = 0
        document, rest = ids[: end - start], ids[end - start :]
        if self._keep is not None and start < self._keep[0] <= start + document.numel():
            (point, callback), self._keep = self._keep, None
            logits = self._read_document(document[: point - start])
            callback(self.memory)
            document = document[point - start :]
        if document.numel():
            logits = self._read_document(document)
        if self._read < end:
            return logits
        self._document_end = None
        if self._write is not None:
            self._write[1].flush()
        self.memory.end_document()
        return self.memory.append(rest) if rest.numel() else logits

    def _read_document(self, ids: torch.Tensor) -> torch.Tensor:
        if self._write is None:
            return self.memory.append(ids, document=True)
        unit, writer = self._write
        for start in range(0, ids.numel(), unit):
            piece = ids[start : start + unit]
            logits, encoding = self.memory.ingest_chunk(piece)
            if piece.numel() == unit:
                writer(self.memory.state_hash, encoding)
        return logits

    @property
    def document_left(self) -> int:
        """Tokens of the prompt's document prefill has yet to read (0 once it is read)."""
        return max(self._document_end - self._read, 0) if self._document_end is not None else 0

    def step(self, token_id: int) -> torch.Tensor:
        return self.prefill(torch.tensor([token_id], dtype=torch.long))

    def pop_retrieval_seconds(self) -> float:
        return float(self.memory.pop_retrieval_seconds())

    def decode_row(self, token_id: int) -> DecodeRow:
        assert self._document_end is None, "the prompt is still being read"
        return self.memory.decode_row(token_id)
