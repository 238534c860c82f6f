"""BM25 over a session's memory blocks: the lexical half of the text prior's hybrid rank.

A sentence encoder ranks blocks by meaning, and blocks that say the same kind of thing about
different names sit close together: "the access code of the Velmibra vault" and "... of the
Velmivim vault". A question names what it asks about, and the name's exact words pick the
block that holds it. Okapi BM25 (k1 = 1.2, b = 0.75) scores each block by the question's words
it contains, rarer words counting more; the prior fuses both ranks by reciprocal rank fusion
(docs/decisions/025-hybrid-prior.md).
"""

from __future__ import annotations

import copy
import math
import re
from collections import Counter
from typing import Any

import numpy as np

WORD = re.compile(r"\w+")
K1, B = 1.2, 0.75
RRF_K = 60  # reciprocal rank fusion's constant (Cormack, Clarke and Buettcher, 2009)


def words(text: str) -> list[str]:
    """Lower-cased word tokens of a text."""
    return WORD.findall(text.lower())


class BlockTerms:
    """Term counts of memory blocks 0, 1, ... in order, and their document frequencies."""

    def __init__(self) -> None:
        self._counts: list[Counter[str]] = []
        self._lengths: list[int] = []
        self._df: Counter[str] = Counter()

    def __deepcopy__(self, memo: dict[int, Any]) -> BlockTerms:
        twin = copy.copy(self)  # a block's counts never change once added: share them
        twin._counts, twin._lengths, twin._df = list(self._counts), list(self._lengths), +self._df
        return twin

    def __len__(self) -> int:
        return len(self._counts)

    def add(self, texts: list[str]) -> None:
        for text in texts:
            counts = Counter(words(text))
            self._counts.append(counts)
            self._lengths.append(sum(counts.values()))
            self._df.update(counts.keys())

    def scores(self, query: list[str], first: int, count: int) -> np.ndarray:
        """BM25 of blocks first..first+count-1 for the query's words (count,), float64."""
        n = len(self._counts)
        out = np.zeros(count, dtype=np.float64)
        terms = {t: math.log(1 + (n - self._df[t] + 0.5) / (self._df[t] + 0.5)) for t in query}
        terms = {t: idf for t, idf in terms.items() if self._df[t]}
        if not terms or not n:
            return out
        mean = sum(self._lengths) / n
        for i in range(count):
            counts, length = self._counts[first + i], self._lengths[first + i]
            norm = K1 * (1 - B + B * length / mean) if mean else K1
            for t, idf in terms.items():
                tf = counts.get(t, 0)
                if tf:
                    out[i] += idf * tf * (K1 + 1) / (tf + norm)
        return out


def fuse(dense: np.ndarray, lexical: np.ndarray) -> np.ndarray:
    """Reciprocal rank fusion of two score vectors over the same blocks: sum of 1/(RRF_K + rank)
    over the rankings a block is in; a block with no lexical match has no lexical rank."""
    fused = np.zeros(dense.shape[0], dtype=np.float64)
    fused[np.argsort(-dense, kind="stable")] += 1.0 / (RRF_K + 1 + np.arange(dense.shape[0]))
    matched = np.flatnonzero(lexical > 0)
    if matched.size:
        order = matched[np.argsort(-lexical[matched], kind="stable")]
        fused[order] += 1.0 / (RRF_K + 1 + np.arange(order.size))
    return fused
