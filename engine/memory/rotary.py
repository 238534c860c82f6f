"""Rotary positions as a table, so stored keys can be un-rotated and re-rotated at will.

The model rotates query and key by the angle of their position before handing them to the
attention function. Rotation is invertible, so the frame stores keys *pre-rotary* and rotates
them again at their frame position each time they are used. The table comes from the model's
own rotary module, so any rope scaling it applies (llama3, yarn, ...) is the model's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import PreTrainedModel


class Angles(NamedTuple):
    """cos and sin of some positions, (n, head_dim) each, sin with its first half negated: the
    sign of rotate_half folded in, so a rotation is x * cos + swap_halves(x) * sin."""

    cos: torch.Tensor
    sin: torch.Tensor


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


class RotaryTable:
    """cos/sin of positions 0..max_positions-1, as the model computes them."""

    def __init__(self, model: PreTrainedModel, max_positions: int) -> None:
        rotary = model.get_decoder().rotary_emb
        param = next(model.parameters())
        positions = torch.arange(max_positions, device=param.device)[None]
        # fp32 tables and fp32 math: a bf16 model's keys survive un-rotation and re-rotation.
        cos, sin = rotary(torch.zeros(1, device=param.device, dtype=torch.float32), positions)
        self.cos = cos[0].float()  # (P, head_dim)
        half = self.cos.shape[-1] // 2
        self.sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1).float()
        # Some rope types scale cos and sin by a constant; undoing a rotation divides by it twice.
        self.scale_sq = float(getattr(rotary, "attention_scaling", 1.0)) ** 2

    def angles(self, positions: torch.Tensor) -> Angles:
        """The table's rows for positions (n,) or (..., n): look them up once, rotate often.
        A negative position p rotates backwards (cos(p), -sin(p)): a retrieved row's frame slot
        can be, with fewer sinks than a block."""
        magnitude = positions.abs()
        sin = self.sin[magnitude]
        return Angles(self.cos[magnitude], torch.where(positions[..., None] < 0, -sin, sin))

    def rotate(self, x: torch.Tensor, positions: torch.Tensor | Angles) -> torch.Tensor:
        """x (..., n, head_dim) pre-rotary, positions (n,) or (..., n) (or their angles) ->
        rotated like the model."""
        cos, sin = positions if isinstance(positions, Angles) else self.angles(positions)
        xf = x.float()
        return torch.addcmul(xf * cos, swap_halves(xf), sin).to(x.dtype)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor | Angles) -> torch.Tensor:
        """Inverse of `rotate`: x (..., n, head_dim) as the model rotated it -> pre-rotary."""
        cos, sin = positions if isinstance(positions, Angles) else self.angles(positions)
        xf = x.float()
        out = torch.addcmul(xf * cos, swap_halves(xf), sin, value=-1)
        return (out if self.scale_sq == 1.0 else out / self.scale_sq).to(x.dtype)
