"""The text prior: Decoupled Context Processing's EmbQ(x) . EmbD(c) over a session's memory.

Attention scores alone pick the blocks a question retrieves, and on prose they miss about half
of the facts asked for (docs/decisions/020-recall-diagnosis-framing.md). The prior adds what the DCP
seed retrieves by: every memory block c gets EmbD(c), the sentence encoder's embedding of its
text (decoded from the token ids read), computed once, as the block moves to memory; a
request that names its question x pins the `prior_k` blocks nearest EmbQ(x), each with
`prior_u` neighbouring blocks on either side, into the retrieval of every layer for the
forwards that retrieve (a question's tail, decode steps), next to what the strategy picks by
attention. Reading a document pins nothing.
"""

from __future__ import annotations

import base64
import copy
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.memory.lexical import OVERLAP, BlockWords, names, words

if TYPE_CHECKING:
    from engine.memory.frame_state import FrameState
    from memory_store.client import TextEncoder


PRIOR_META = "prior_embd"  # a stored chunk's meta: EmbD of the blocks its commit added
# a block's lexical share (0..1) beside its cosine: a block holding the question's rare words
# outranks blocks the encoder scores a few hundredths higher (docs/decisions/074-lexical-prior.md)
LEXICAL_WEIGHT = 0.5
# hybrid: when the question's words single blocks out, the prior pins only the lines whose score
# is this close to the best (up to k): a block missing about a fifth of the question's rare
# words' weight is left to the strategy, so same-kind sentences naming others stay out
PRIOR_MARGIN = 0.1


def pack_rows(rows: np.ndarray) -> dict[str, Any]:
    """float32 rows (n, dim) as JSON (a chunk encoding's meta)."""
    rows = np.ascontiguousarray(rows, dtype="<f4")
    return {"shape": list(rows.shape), "b64": base64.b64encode(rows.tobytes()).decode("ascii")}


def unpack_rows(packed: Any) -> np.ndarray:
    """pack_rows' rows back; an empty (0, 0) array when `packed` is not such a record."""
    try:
        n, dim = (int(x) for x in packed["shape"])
        data = base64.b64decode(packed["b64"], validate=True)
        return np.frombuffer(data, dtype="<f4").reshape(n, dim).astype(np.float32)
    except (KeyError, TypeError, ValueError):
        return np.zeros((0, 0), dtype=np.float32)


class TextPrior:
    """One session's token ids, the EmbD of its memory blocks, and the request's EmbQ."""

    def __init__(
        self,
        encoder: TextEncoder,
        decode: Callable[[Sequence[int]], str],
        k: int,
        u: int,
        block: int,
        by_relevance: bool = False,
        lexical: bool = False,
        named: bool = False,
    ) -> None:
        self.encoder, self.decode = encoder, decode
        self.lexical = lexical  # hybrid: EmbQ . EmbD plus the question's rare words (lexical.py)
        self.named = named  # the margin also keeps lines naming everything the question names
        self._words = BlockWords()  # words of blocks 0, 1, ... (lazily)
        self._query_words: frozenset[str] = frozenset()
        self._query_names: frozenset[str] = frozenset()
        self.k, self.u, self.block = k, u, block
        self.by_relevance = by_relevance  # rows least relevant first, else ascending
        self._ids: list[np.ndarray] = []  # every token read, in order (joined lazily)
        self._num_ids = 0
        self._emb = np.zeros((0, 0), dtype=np.float32)  # EmbD of blocks 0, 1, ... (lazily)
        self._given: np.ndarray | None = None  # EmbD of the next commit's blocks, from a store
        self._query: np.ndarray | None = None
        self._rows: tuple[tuple[int, int], torch.Tensor] | None = None  # memory state -> rows
        self.seconds = 0.0

    def __deepcopy__(self, memo: dict[int, Any]) -> TextPrior:
        """A fork's prior shares the encoder and decoder, and copies the rest."""
        twin = copy.copy(self)
        twin._ids = list(self._ids)
        twin._emb = self._emb.copy()
        twin._words = self._words.copy()
        return twin

    def read(self, ids: torch.Tensor) -> None:
        """Tokens appended to the session, in order."""
        piece = ids.reshape(-1).cpu().numpy().astype(np.int64)
        self._ids.append(piece)
        self._num_ids += piece.size

    def token_ids(self) -> np.ndarray:
        """Every token read, in order (int64)."""
        return self._joined_ids()

    def truncate(self, num_tokens: int) -> None:
        """Forget the token ids read after the first num_tokens (a rewind; memory blocks, and
        so their EmbD, are unchanged)."""
        if num_tokens < self._num_ids:
            ids = np.concatenate(self._ids) if self._ids else np.zeros(0, dtype=np.int64)
            self._ids, self._num_ids = [ids[:num_tokens]], num_tokens

    def set_query(self, text: str | None) -> None:
        """EmbQ(text) for the forwards of the request under way; None clears it."""
        self._rows = None
        if not text or not text.strip():
            self._query, self._query_words, self._query_names = None, frozenset(), frozenset()
            return
        self._query_words = words(text) if self.lexical else frozenset()
        self._query_names = names(text) if self.named else frozenset()
        started = time.perf_counter()
        self._query = self.encoder.embed([text])[0]
        self.seconds += time.perf_counter() - started

    def embed(self, frame: FrameState) -> None:
        """EmbD (and, hybrid, the words) of every block the frame's memory holds now (those not
        done yet)."""
        try:
            if frame.n_memory:
                dropped = frame.num_tokens - frame.n_sinks - frame.n_local - frame.n_memory
                blocks = (dropped + frame.n_memory) // self.block
                self._embedded(frame.n_sinks, blocks)
                if self.lexical:
                    self._block_words(frame.n_sinks, blocks)
        finally:
            self._given = None

    @property
    def num_embedded(self) -> int:
        return int(self._emb.shape[0])

    def embedded_since(self, count: int) -> np.ndarray:
        """EmbD of the blocks embedded after the first `count`: what a commit added, to store
        with its chunk."""
        return self._emb[count:].copy()

    def give(self, rows: np.ndarray) -> None:
        """EmbD (n, dim) that the next `embed` takes for the blocks it adds, when they are n
        (a chunk imported from the store brings what its first reader computed)."""
        dim = self._emb.shape[1] if self._emb.size else getattr(self.encoder, "dim", None)
        if rows.ndim == 2 and rows.shape[1] == dim:
            self._given = np.asarray(rows, dtype=np.float32)

    def rows(self, frame: FrameState) -> torch.Tensor | None:
        """Memory rows (R,) that the request's question pins, or None: ascending, or (by
        relevance) block by block from the least to the most relevant line (a top block with
        its neighbours, ascending; a block shared by two lines goes with the better one)."""
        if self._query is None or not frame.n_memory or not self.k:
            return None
        dropped = frame.num_tokens - frame.n_sinks - frame.n_local - frame.n_memory
        key = (dropped, frame.n_memory)
        if self._rows is not None and self._rows[0] == key:
            return self._rows[1]
        count = frame.n_memory // self.block
        scores, lexical = self._scores(frame)
        top = np.argsort(-scores, kind="stable")[: self.k]
        if lexical.any():  # the question's words single some blocks out: only those near the best
            keep = scores[top] >= scores[top[0]] - PRIOR_MARGIN
            if self._query_names:  # and (named) every block naming what the question names
                named = self._words.holding(self._query_names, dropped // self.block, count)
                keep |= named[top]
            top = top[keep]
        lines = (top[:, None] + np.arange(-self.u, self.u + 1)[None]).clip(0, count - 1)
        if self.by_relevance:
            best: dict[int, int] = {}  # block -> the best rank of a line holding it
            for rank, line in enumerate(lines.tolist()):
                for b in line:
                    best.setdefault(b, rank)
            blocks = np.array(sorted(best, key=lambda b: (-best[b], b)), dtype=np.int64)
        else:
            blocks = np.unique(lines)
        rows = (blocks[:, None] * self.block + np.arange(self.block)[None]).reshape(-1)
        pinned = torch.from_numpy(rows).to(frame.device)
        self._rows = (key, pinned)
        return pinned

    def block_scores(self, frame: FrameState) -> np.ndarray:
        """(memory blocks,) the question's score of every block memory holds: EmbQ . EmbD, plus
        LEXICAL_WEIGHT times the block's lexical share (hybrid)."""
        return self._scores(frame)[0]

    def _scores(self, frame: FrameState) -> tuple[np.ndarray, np.ndarray]:
        """block_scores, and the lexical shares in them (zeros unless hybrid)."""
        assert self._query is not None
        dropped = frame.num_tokens - frame.n_sinks - frame.n_local - frame.n_memory
        first, count = dropped // self.block, frame.n_memory // self.block
        emb = self._embedded(frame.n_sinks, first + count)[first:]  # (count, dim)
        lexical = np.zeros(count, dtype=np.float32)
        if self._query_words:
            held = self._block_words(frame.n_sinks, first + count)
            lexical = held.scores(self._query_words, first, count)
        return emb @ self._query + LEXICAL_WEIGHT * lexical, lexical

    def _embedded(self, sinks: int, blocks: int) -> np.ndarray:
        """EmbD of memory blocks 0..blocks-1 (block b: tokens sinks + b*block onwards)."""
        have = self._emb.shape[0]
        given, self._given = self._given, None
        if have < blocks and given is not None and given.shape[0] == blocks - have:
            self._emb = np.concatenate((self._emb, given)) if have else given.copy()
        if have < blocks and self._emb.shape[0] < blocks:
            started = time.perf_counter()
            ids = self._joined_ids()
            texts = [
                self.decode(ids[sinks + b * self.block : sinks + (b + 1) * self.block].tolist())
                for b in range(have, blocks)
            ]
            new = np.asarray(self.encoder.embed(texts), dtype=np.float32)
            self._emb = np.concatenate((self._emb, new)) if have else new
            self.seconds += time.perf_counter() - started
        return self._emb[:blocks]

    def _joined_ids(self) -> np.ndarray:
        """Every token id read, as one array (kept joined for the next call)."""
        if len(self._ids) > 1:
            self._ids = [np.concatenate(self._ids)]
        return self._ids[0]

    def _block_words(self, sinks: int, blocks: int) -> BlockWords:
        """The words of memory blocks 0..blocks-1, each read with OVERLAP tokens either side."""
        have = len(self._words)
        if have < blocks:
            started = time.perf_counter()
            ids = self._joined_ids()
            found = []
            for b in range(have, blocks):
                start = max(sinks, sinks + b * self.block - OVERLAP)
                piece = ids[start : sinks + (b + 1) * self.block + OVERLAP]
                found.append(words(self.decode(piece.tolist())))
            self._words.add(found)
            self.seconds += time.perf_counter() - started
        return self._words

    def nbytes(self) -> int:
        return self._num_ids * 8 + self._emb.nbytes + self._words.nbytes()

    def pop_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def merge_rows(
    idx: torch.Tensor | None, pinned: torch.Tensor, kv_heads: int, keep_order: bool = False
) -> torch.Tensor:
    """The union of a strategy's rows idx (kv_heads, R), ascending, -1 padded (or None) and
    pinned rows (P,): (kv_heads, R') ascending per head, each row once, -1 padded at the end.
    keep_order: the strategy's rows not pinned (ascending, -1 padded at the end), then the
    pinned rows in their own order."""
    pinned = pinned[None].expand(kv_heads, -1)
    if idx is None or not idx.shape[1]:
        return pinned.contiguous()
    if keep_order:
        rest = torch.where(_pinned_mask(idx, pinned[0]), -1, idx)
        big = torch.iinfo(rest.dtype).max
        rest = torch.where(rest < 0, big, rest).sort(dim=1).values
        width = int((rest < big).sum(dim=1).max())
        rest = torch.where(rest[:, :width] == big, -1, rest[:, :width])
        return torch.cat((rest, pinned), dim=1)
    both = torch.cat((idx, pinned), dim=1)
    big = torch.iinfo(both.dtype).max
    both = torch.where(both < 0, big, both).sort(dim=1).values
    repeat = torch.zeros_like(both, dtype=torch.bool)
    repeat[:, 1:] = both[:, 1:] == both[:, :-1]
    both = torch.where(repeat, big, both).sort(dim=1).values
    width = int((both < big).sum(dim=1).max())
    both = both[:, :width]
    return torch.where(both == big, -1, both)


def _pinned_mask(idx: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
    """idx (kv_heads, R) rows, -1 padded, and pinned (P,) rows -> (kv_heads, R) bool: which of
    idx are pinned. A lookup table over the rows, where torch.isin sorts both (~20x slower at a
    question's 3,072 rows by 1,536); -1 reads the table's spare last slot, always False."""
    if not pinned.numel():
        return torch.zeros_like(idx, dtype=torch.bool)
    size = int(torch.maximum(idx.max(), pinned.max())) + 1
    table = torch.zeros(size + 1, dtype=torch.bool, device=idx.device)
    table[pinned] = True
    return table[idx]
