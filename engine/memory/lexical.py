"""The text prior's lexical side: how much of a question's rare words a memory block holds.

A question about a long document often names what it asks for (a person, a contract, a section,
an identifier): a word that is rare in the document and sits beside the answer. A sentence
encoder scores every sentence of the asked-for kind alike (all the ship registrations of a
register), so the prior pins them all and the model copies the wrong one
(docs/decisions/074-lexical-prior.md). Here a block's score is the IDF-weighted share of the
question's words it holds, IDF over the session's blocks: 1 for a block holding every word the
document has, near 0 for one holding only words every block has.
"""

from __future__ import annotations

import math
import re
from array import array

import numpy as np

_WORD = re.compile(r"[^\W_]{3,}")  # letters and digits, three or more: no "a", "of", "is"
OVERLAP = 8  # tokens of each neighbouring block read with a block: a word cut at a border counts


def words(text: str) -> frozenset[str]:
    return frozenset(w.lower() for w in _WORD.findall(text))


def names(text: str) -> frozenset[str]:
    """The words a question names things by: capitalized where a sentence does not start, or
    holding a digit ("the Zueldcor expedition", "clause 191"), lowercased as `words` gives them.
    One pass: each word looks back over the spaces before it only."""
    out = set()
    for m in _WORD.finditer(text):
        w, i = m.group(), m.start() - 1
        while i >= 0 and text[i].isspace():
            i -= 1
        opens = i < 0 or (text[i] in ".!?:" and i < m.start() - 1)  # a sentence starts here
        if (w[0].isupper() and not opens) or any(c.isdigit() for c in w):
            out.add(w.lower())
    return frozenset(out)


class BlockWords:
    """Which memory blocks hold each word (postings), block numbers from 0."""

    def __init__(self) -> None:
        self.postings: dict[str, array[int]] = {}
        self.count = 0  # blocks added

    def __len__(self) -> int:
        return self.count

    def copy(self) -> BlockWords:
        twin = BlockWords()
        twin.postings = {w: blocks[:] for w, blocks in self.postings.items()}
        twin.count = self.count
        return twin

    def add(self, block_words: list[frozenset[str]]) -> None:
        for found in block_words:
            for w in found:
                self.postings.setdefault(w, array("I")).append(self.count)
            self.count += 1

    def scores(self, question: frozenset[str], first: int, count: int) -> np.ndarray:
        """(count,) share in [0, 1] of the question's IDF weight held by blocks first.."""
        out = np.zeros(count, dtype=np.float32)
        held = {w: self.postings[w] for w in question if w in self.postings}
        idf = {w: math.log((self.count + 1) / (len(b) + 0.5)) for w, b in held.items()}
        weight = sum(idf.values())
        if weight <= 0:
            return out
        for w, blocks in held.items():
            at = np.frombuffer(blocks, dtype=np.uint32).astype(np.int64) - first
            at = at[(at >= 0) & (at < count)]
            out[at] += idf[w] / weight
        return out

    def holding(self, named: frozenset[str], first: int, count: int) -> np.ndarray:
        """(count,) bool: blocks first.. holding every one of `named` the document holds (all
        False when it holds none)."""
        out = np.zeros(count, dtype=bool)
        held = [self.postings[w] for w in named if w in self.postings]
        if not held:
            return out
        out[:] = True
        for blocks in held:
            at = np.frombuffer(blocks, dtype=np.uint32).astype(np.int64) - first
            mask = np.zeros(count, dtype=bool)
            mask[at[(at >= 0) & (at < count)]] = True
            out &= mask
        return out

    def nbytes(self) -> int:
        return sum(len(w) + 80 + 4 * len(b) for w, b in self.postings.items())
