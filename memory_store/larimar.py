"""Larimar associative memory, per session, in host memory (numpy).

Following "Needle in the Haystack for Memory Based LLMs" (Nelson et al., 2024):

- A document is cut into segments (sentences). Each segment i has an encoding z_i (row of Z,
  `(N, C)`) and a *writing key* built from the encoding of its fixed-length prefix (its first
  `prefix_length` words, the whole sentence if shorter).
- The key memory M~ (`(K, C)`) holds one prefix encoding per distinct prefix. Segment i is
  addressed one-hot at its nearest key row k*(z~_i) = argmin_k ||z~_i - M~_k||, so segments with
  the same prefix share a slot (the passkey filler repeats all land in a few slots).
- Write: M = W^+ Z, the least-squares solution of min ||Z - W M||. Two solvers: the general one
  (`np.linalg.lstsq`, any W) and the one-hot fast path (W one-hot with full column rank makes
  W^+ Z the per-slot mean of Z; unique keys make W a permutation and M = Z, no solve at all).
- Read: encode the query's prefix (or the whole query), take the nearest key row as a one-hot
  w, read z = w M.

longserve has NO Larimar-trained latent decoder: z is not decoded into text. The readout
identifies the stored segment(s) of the winning slot; their text (or their stored encodings in
the encoder-output store) is what then conditions the LLM decoder.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

from memory_store.backends.base import Backend
from memory_store.embedder import TextEncoder
from memory_store.errors import InvalidStoreRequest, NotFound, StoreError
from memory_store.keys import KeySpace

Solver = Literal["auto", "one_hot", "lstsq"]

# ---------------------------------------------------------------------------------------------
# Segmentation.
# ---------------------------------------------------------------------------------------------

# A sentence ends at . ! ? (optionally followed by closing quotes/brackets) before whitespace and
# an opening capital, digit or quote; blank lines always end one.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'\u201d\u2019)\]]*\s+(?=[\"'\u201c\u2018(\[]?[A-Z0-9])")
_PARAGRAPH = re.compile(r"\n\s*\n")
_WORD = re.compile(r"\S+")


def split_sentences(text: str, max_words: int = 128) -> list[str]:
    """Sentences of `text`, whitespace-normalized; runs longer than `max_words` are cut."""
    out: list[str] = []
    for paragraph in _PARAGRAPH.split(text):
        for sentence in _SENTENCE_END.split(paragraph):
            words = _WORD.findall(sentence)
            for start in range(0, len(words), max_words):
                piece = " ".join(words[start : start + max_words])
                if piece:
                    out.append(piece)
    return out


def prefix_of(text: str, prefix_length: int) -> str:
    """The first `prefix_length` words (the whole text if shorter)."""
    return " ".join(_WORD.findall(text)[:prefix_length])


# ---------------------------------------------------------------------------------------------
# The linear-algebra core.
# ---------------------------------------------------------------------------------------------


def one_hot_weights(slot_of: np.ndarray, num_slots: int) -> np.ndarray:
    """W `(N, K)`: row i is one-hot at slot_of[i]."""
    w = np.zeros((slot_of.shape[0], num_slots), dtype=np.float32)
    w[np.arange(slot_of.shape[0]), slot_of] = 1.0
    return w


def write_lstsq(w: np.ndarray, z: np.ndarray) -> np.ndarray:
    """M = W^+ Z for any addressing weights W `(N, K)` and encodings Z `(N, C)` -> `(K, C)`."""
    m, *_ = np.linalg.lstsq(w.astype(np.float64), z.astype(np.float64), rcond=None)
    return m.astype(np.float32)


def write_one_hot(slot_of: np.ndarray, z: np.ndarray, num_slots: int) -> np.ndarray:
    """W^+ Z for one-hot W without forming W: the mean of the rows written to each slot.

    Every slot must be used (full column rank), which the key memory guarantees. With unique
    keys in slot order this is Z itself.
    """
    n = slot_of.shape[0]
    if n == num_slots and np.array_equal(slot_of, np.arange(n)):
        return z.astype(np.float32, copy=True)
    counts = np.bincount(slot_of, minlength=num_slots).astype(np.float64)
    if np.any(counts == 0):
        raise ValueError("every slot needs at least one segment for the one-hot write")
    # Few slots (the repetitive case): one masked sum per slot (no BLAS, whose threads thrash on
    # a busy host). Many: one weighted bincount per column. Not np.add.at, which was far slower
    # (docs/decisions/050-larimar-one-hot-write.md).
    if num_slots <= 256:
        sums = np.stack([z[slot_of == k].sum(axis=0, dtype=np.float64) for k in range(num_slots)])
        return (sums / counts[:, None]).astype(np.float32)
    means = np.empty((num_slots, z.shape[1]), dtype=np.float32)
    for c in range(z.shape[1]):
        means[:, c] = np.bincount(slot_of, weights=z[:, c], minlength=num_slots) / counts
    return means


# ---------------------------------------------------------------------------------------------
# One session's memory.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LarimarConfig:
    """`prefix_length`: words in the fixed-length prefix that builds the writing/reading keys
    (4 in the paper). `solver`: how M = W^+ Z is computed ("auto" = one-hot fast path)."""

    prefix_length: int = 4
    solver: Solver = "auto"
    max_segment_words: int = 128

    def __post_init__(self) -> None:
        if self.prefix_length < 1:
            raise InvalidStoreRequest("prefix_length must be >= 1")
        if self.solver not in ("auto", "one_hot", "lstsq"):
            raise InvalidStoreRequest(f"unknown solver {self.solver!r}")


@dataclass(frozen=True)
class LarimarHit:
    """One slot of a read: the segments written there, and how close its key was."""

    slot: int
    segment_indices: tuple[int, ...]
    texts: tuple[str, ...]
    distance: float  # ||z~_query - M~_slot||


class LarimarMemory:
    """The numeric state of one session: segments, Z, key memory M~, slot map, and M."""

    def __init__(self, dim: int, config: LarimarConfig | None = None) -> None:
        self.config = config or LarimarConfig()
        self.dim = dim
        self.segments: list[str] = []
        self.z = np.zeros((0, dim), dtype=np.float32)  # (N, C)
        self.key_memory = np.zeros((0, dim), dtype=np.float32)  # (K, C)
        self.key_texts: list[str] = []  # prefix text of each slot
        self.slot_of = np.zeros((0,), dtype=np.int64)  # (N,)
        self.memory = np.zeros((0, dim), dtype=np.float32)  # M, (K, C)
        self._slot_by_prefix: dict[str, int] = {}

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def num_slots(self) -> int:
        return self.key_memory.shape[0]

    def write(
        self, segments: Sequence[str], z: np.ndarray, prefixes: Sequence[str], z_prefix: np.ndarray
    ) -> None:
        """Append segments with encodings `(n, C)` and prefix encodings `(n, C)`; rebuild M."""
        n = len(segments)
        if z.shape != (n, self.dim) or z_prefix.shape != (n, self.dim) or len(prefixes) != n:
            raise InvalidStoreRequest("segments, prefixes and their encodings must line up")
        new_keys: list[np.ndarray] = []
        slots = np.empty((n,), dtype=np.int64)
        for i, p in enumerate(prefixes):
            key = p.casefold()
            slot = self._slot_by_prefix.get(key)
            if slot is None:  # a new prefix gets its own row of the key memory
                slot = self.num_slots + len(new_keys)
                self._slot_by_prefix[key] = slot
                self.key_texts.append(p)
                new_keys.append(z_prefix[i])
            slots[i] = slot
        self.segments.extend(segments)
        self.z = np.concatenate([self.z, z.astype(np.float32)], axis=0)
        if new_keys:
            self.key_memory = np.concatenate([self.key_memory, np.stack(new_keys)], axis=0)
        self.slot_of = np.concatenate([self.slot_of, slots])
        self._solve()

    def _solve(self) -> None:
        if self.config.solver == "lstsq":
            w = one_hot_weights(self.slot_of, self.num_slots)
            self.memory = write_lstsq(w, self.z)
        else:
            self.memory = write_one_hot(self.slot_of, self.z, self.num_slots)

    def nearest_slots(self, z_query: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """The `top_k` key rows closest (L2) to the query key encoding: (slots, distances)."""
        if self.num_slots == 0:
            raise NotFound("the Larimar memory is empty")
        d2 = np.sum((self.key_memory - z_query.reshape(1, -1)) ** 2, axis=1)  # (K,)
        k = min(top_k, d2.shape[0])
        top = np.argpartition(d2, k - 1)[:k]
        top = top[np.argsort(d2[top], kind="stable")]
        return top, np.sqrt(np.maximum(d2[top], 0.0))

    def read_vector(self, slot: int) -> np.ndarray:
        """z = w M with w one-hot at `slot`."""
        w = np.zeros((self.num_slots,), dtype=np.float32)
        w[slot] = 1.0
        return w @ self.memory

    def read(self, z_query: np.ndarray, top_k: int = 3) -> list[LarimarHit]:
        slots, dists = self.nearest_slots(z_query, top_k)
        hits = []
        for slot, dist in zip(slots.tolist(), dists.tolist(), strict=True):
            idx = tuple(int(i) for i in np.flatnonzero(self.slot_of == slot))
            hits.append(LarimarHit(slot, idx, tuple(self.segments[i] for i in idx), float(dist)))
        return hits

    # Persistence ------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        header = {
            "config": asdict(self.config),
            "dim": self.dim,
            "segments": self.segments,
            "key_texts": self.key_texts,
        }
        buf = io.BytesIO()
        np.savez(
            buf,
            header=np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8),
            z=self.z,
            key_memory=self.key_memory,
            slot_of=self.slot_of,
        )
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> LarimarMemory:
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as f:
                header = json.loads(f["header"].tobytes().decode("utf-8"))
                mem = cls(int(header["dim"]), LarimarConfig(**header["config"]))
                mem.segments = list(header["segments"])
                mem.key_texts = list(header["key_texts"])
                mem.z = f["z"].astype(np.float32)
                mem.key_memory = f["key_memory"].astype(np.float32)
                mem.slot_of = f["slot_of"].astype(np.int64)
        except (KeyError, ValueError, OSError) as e:
            raise StoreError(f"stored Larimar memory is unreadable: {e}") from e
        mem._slot_by_prefix = {t.casefold(): i for i, t in enumerate(mem.key_texts)}
        if mem.num_segments:
            mem._solve()
        return mem


# ---------------------------------------------------------------------------------------------
# Per-session memories over a backend.
# ---------------------------------------------------------------------------------------------


class LarimarStore:
    """Sessions' Larimar memories in host memory, persisted through the backend on `save`.

    `encoder` is a TextEncoder, or a zero-argument callable returning one (so the model loads
    only when the first text arrives).
    """

    def __init__(
        self,
        backend: Backend,
        encoder: TextEncoder | Callable[[], TextEncoder],
        config: LarimarConfig | None = None,
    ) -> None:
        self.backend = backend
        self._encoder = encoder
        self.config = config or LarimarConfig()
        self._memories: dict[str, LarimarMemory] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def _get_encoder(self) -> TextEncoder:
        if callable(self._encoder) and not hasattr(self._encoder, "embed"):
            self._encoder = self._encoder()
        return self._encoder  # type: ignore[return-value]

    def _lock(self, session_id: str) -> asyncio.Lock:
        return self._locks.setdefault(session_id, asyncio.Lock())

    async def _memory(self, session_id: str, *, create: bool) -> LarimarMemory:
        KeySpace.session_tag(session_id)  # validates the id
        mem = self._memories.get(session_id)
        if mem is not None:
            return mem
        try:
            return await self._load_unlocked(session_id)
        except NotFound:
            if not create:
                raise
        mem = LarimarMemory(self._get_encoder().dim, self.config)
        self._memories[session_id] = mem
        return mem

    async def write(
        self, session_id: str, *, text: str | None = None, segments: Sequence[str] | None = None
    ) -> int:
        """Segment `text` (or take `segments` as given), encode, write. Returns segments written."""
        if (text is None) == (segments is None):
            raise InvalidStoreRequest("give exactly one of text and segments")
        if text is not None:
            segs = split_sentences(text, self.config.max_segment_words)
        else:
            segs = [" ".join(_WORD.findall(s)) for s in (segments or [])]
            segs = [s for s in segs if s]
        if not segs:
            return 0
        prefixes = [prefix_of(s, self.config.prefix_length) for s in segs]
        # One forward over the distinct texts (filler repeats a lot); the encoder is CPU-bound.
        distinct = list(dict.fromkeys([*segs, *prefixes]))
        row = {t: i for i, t in enumerate(distinct)}
        encoded = await asyncio.to_thread(self._get_encoder().embed, distinct)
        z = encoded[[row[s] for s in segs]]
        z_prefix = encoded[[row[p] for p in prefixes]]
        async with self._lock(session_id):
            mem = await self._memory(session_id, create=True)
            mem.write(segs, z, prefixes, z_prefix)
        return len(segs)

    async def read(
        self, session_id: str, query: str, top_k: int = 3, use_prefix: bool = True
    ) -> list[LarimarHit]:
        """Nearest slots to the query's prefix encoding (or the whole query's), best first."""
        if top_k < 1:
            raise InvalidStoreRequest("top_k must be >= 1")
        async with self._lock(session_id):
            mem = await self._memory(session_id, create=False)
        probe = prefix_of(query, mem.config.prefix_length) if use_prefix else query
        if not probe.strip():
            raise InvalidStoreRequest("empty query")
        z_query = (await asyncio.to_thread(self._get_encoder().embed, [probe]))[0]
        return mem.read(z_query, top_k)

    async def info(self, session_id: str) -> dict[str, int]:
        async with self._lock(session_id):
            mem = await self._memory(session_id, create=False)
        return {"segments": mem.num_segments, "slots": mem.num_slots, "dim": mem.dim}

    async def save(self, session_id: str) -> None:
        """Persist the session's memory; returns once the backend holds it."""
        async with self._lock(session_id):
            mem = self._memories.get(session_id)
            if mem is None:
                raise NotFound(f"no Larimar memory in host memory for session {session_id}")
            data = mem.to_bytes()
        await self.backend.put_blob(KeySpace.larimar(session_id), data)

    async def _load_unlocked(self, session_id: str) -> LarimarMemory:
        try:
            data = await self.backend.get_blob(KeySpace.larimar(session_id))
        except NotFound as e:
            raise NotFound(f"session {session_id} has no Larimar memory") from e
        mem = LarimarMemory.from_bytes(data)
        self._memories[session_id] = mem
        return mem

    async def load(self, session_id: str) -> LarimarMemory:
        """(Re)load the session's memory from the backend into host memory."""
        async with self._lock(session_id):
            return await self._load_unlocked(session_id)

    def evict(self, session_id: str) -> bool:
        """Drop the host-memory copy (the saved one stays)."""
        self._locks.pop(session_id, None)
        return self._memories.pop(session_id, None) is not None

    async def delete(self, session_id: str) -> None:
        """Forget the session's memory in host memory and in the backend."""
        self.evict(session_id)
        await self.backend.delete(KeySpace.larimar(session_id))
