"""Context-aware decoding (CAD; Shi et al. 2023, "Trusting Your Evidence"): an answer's next
token scored by how much the retrieved context raises it over the same question without it.

    score(y) = (1 + alpha) log p(y | frame) - alpha log p(y | question alone)

A token the model would write whether or not it read the frame (counting on from the last
number it wrote, a list's next line) loses to one the frame supports (the next value it
holds). Tokens the frame's own distribution finds implausible (below PLAUSIBLE times its most
likely token; Li et al. 2023's adaptive plausibility) are pushed far down, not removed, so a
grammar that allows only such tokens still has a finite choice
(docs/decisions/097-context-aware-decoding.md).

`PairedRow` is one request's two rows of a batched decode forward: the frame's and the bare
question's; `decode_batch` (engine/runner/decode_state.py) runs both and hands back `combine`d
logits.
"""

from __future__ import annotations

import math

import torch

from engine.runner.rows import DecodeRow

PLAUSIBLE = 0.1  # beta: tokens under this share of the frame's most likely one are pushed down
PUSHED_DOWN = 1e4  # how far below: far enough that no sampler picks them, finite for grammars


def contrast(with_frame: torch.Tensor, bare: torch.Tensor, alpha: float) -> torch.Tensor:
    """CAD's scores (vocab,) from the logits with the frame and without it; alpha 0 gives the
    frame's log-probabilities (the same choices as its logits)."""
    framed = with_frame.float().log_softmax(-1)
    scores = (1 + alpha) * framed - alpha * bare.float().log_softmax(-1)
    implausible = framed < framed.max() + math.log(PLAUSIBLE)
    return torch.where(implausible, scores - PUSHED_DOWN, scores).to(with_frame.dtype)


class PairedRow:
    """A request's token as two rows of one decode forward: `parts` (frame row, bare row)."""

    def __init__(self, framed: DecodeRow, bare: DecodeRow, alpha: float) -> None:
        self.parts = (framed, bare)
        self.alpha = alpha

    def combine(self, logits: torch.Tensor) -> torch.Tensor:
        """The two parts' logits (2, vocab) -> the request's scores (vocab,)."""
        return contrast(logits[0], logits[1], self.alpha)
