"""Numbers copied, not invented (memory knob `copy_numbers`): while an answer writes a run of
`least` or more digits, the run must be a prefix of a number the frame holds, and it may end
only where such a number ends.

A small model answering over retrieved text writes the right code's first digits and then
counts on ("5835475, 5835476, ..."), or invents a placeholder ("123456789012345"): the
digits do not come from what it read (docs/decisions/098-numbers-copied.md). Shorter runs
(a list's "1.", a count, a year when `least` is 5) stay free. The mask works on tokenizers that
give every digit a token of its own (SmolLM2, Llama 2, Mistral): `digit_tokens` finds them and
says None for any other, which the knob then refuses.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

ASCII = frozenset("0123456789")  # str.isdigit also takes "²" (a byte-level piece of other text)


def digit_tokens(tokenizer: Any) -> tuple[int, ...] | None:
    """The token ids of "0".."9" when each digit is a token of its own and no other token holds
    a digit, else None."""
    ids = []
    for digit in "0123456789":
        encoded = tokenizer.encode(digit, add_special_tokens=False)
        if len(encoded) != 1:
            return None
        ids.append(int(encoded[0]))
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    holding = {i for i, piece in enumerate(pieces) if piece and any(c in ASCII for c in piece)}
    return tuple(ids) if holding == set(ids) else None


def numbers_in(ids: Iterable[int], digits: Sequence[int], least: int) -> list[str]:
    """The maximal digit runs of ids (token ids) at least `least` digits long, as strings."""
    array = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
    value = np.full(array.shape, -1, dtype=np.int64)
    for d, token in enumerate(digits):
        value[array == token] = d
    is_digit = np.concatenate([[False], value >= 0, [False]])
    edges = np.flatnonzero(is_digit[1:] != is_digit[:-1])  # starts and stops alternate
    runs = []
    for start, stop in zip(edges[::2], edges[1::2], strict=True):
        if stop - start >= least:
            runs.append("".join(str(int(d)) for d in value[start:stop]))
    return runs


class NumberCopy:
    """One answer's digit-run state and the mask it puts on each next token."""

    def __init__(self, digits: Sequence[int], source_ids: Iterable[int], least: int) -> None:
        self._digits = list(digits)
        self._least = least
        found = numbers_in(source_ids, digits, least)
        self._complete = set(found)
        self._sorted = sorted(self._complete)
        self._run = ""  # the answer's digits since its last non-digit token

    def _prefix(self, run: str) -> bool:
        at = bisect.bisect_left(self._sorted, run)
        return at < len(self._sorted) and self._sorted[at].startswith(run)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (vocab,) with the digits that would leave every source number, and (inside
        an unfinished number) every non-digit token, at -inf; logits itself when none is."""
        run = self._run
        if len(run) + 1 < self._least:
            return logits  # any next token leaves the run shorter than `least`
        barred = [token for d, token in enumerate(self._digits) if not self._prefix(run + str(d))]
        ends = len(run) < self._least or run in self._complete
        if ends and not barred:
            return logits
        if ends:
            index = torch.tensor(barred, dtype=torch.long, device=logits.device)
            return logits.index_fill(0, index, float("-inf"))
        kept = [t for t in self._digits if t not in barred]
        if not kept:  # the run left the source unmasked (a grammar's fallback): let it go
            return logits
        out = torch.full_like(logits, float("-inf"))
        index = torch.tensor(kept, dtype=torch.long, device=logits.device)
        return out.index_copy(0, index, logits.index_select(0, index))

    def advance(self, token_id: int) -> None:
        if token_id in self._digits:
            self._run += str(self._digits.index(token_id))
        else:
            self._run = ""
