"""Rotary positions as a table, so stored keys can be un-rotated and re-rotated at will.

The model rotates query and key by the angle of their position before handing them to the
attention function. Rotation is invertible, so the frame stores keys *pre-rotary* and rotates
them again at their frame position each time they are used. The table comes from the model's
own rotary module, so any rope scaling it applies (llama3, yarn, ...) is the model's.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryTable:
    """cos/sin of positions 0..max_positions-1, as the model computes them."""

    def __init__(self, model: PreTrainedModel, max_positions: int) -> None:
        rotary = model.get_decoder().rotary_emb
        param = next(model.parameters())
        positions = torch.arange(max_positions, device=param.device)[None]
        # fp32 tables and fp32 math: a bf16 model's keys survive un-rotation and re-rotation.
        cos, sin = rotary(torch.zeros(1, device=param.device, dtype=torch.float32), positions)
        self.cos = cos[0].float()  # (P, head_dim)
        self.sin = sin[0].float()
        # Some rope types scale cos and sin by a constant; undoing a rotation divides by it twice.
        self.scale_sq = float(getattr(rotary, "attention_scaling", 1.0)) ** 2

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (..., n, head_dim) pre-rotary, positions (n,) or (..., n) -> rotated like the model."""
        cos, sin = self.cos[positions], self.sin[positions]
        xf = x.float()
        return (xf * cos + rotate_half(xf) * sin).to(x.dtype)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Inverse of `rotate`: x (..., n, head_dim) as the model rotated it -> pre-rotary."""
        cos, sin = self.cos[positions], self.sin[positions]
        xf = x.float()
        out = xf * cos - rotate_half(xf) * sin
        return (out if self.scale_sq == 1.0 else out / self.scale_sq).to(x.dtype)
