"""Linear layers whose weights are kept, and multiplied, in a lower precision than the model.

A decode step on a CPU reads every weight once per token and little else: SmolLM2's 538 MB of
fp32 linear weights take ~33 ms at this machine's ~16 GB/s, most of a ~40 ms step
(`longserve bench decode_floor`). Halving the bytes (bf16) halves that part. Keeping the rest of
the model (embeddings, norms, the KV cache, memory frames, attention) in fp32 matters: bf16
attention over a 4K-token cache on this CPU was slower than fp32 (docs/decisions/033).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LowPrecisionLinear(torch.nn.Module):
    """y = x W^T (+ b), W stored in `dtype`; x is cast to it and y back to x's dtype."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(dtype)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, weight={self.weight.dtype}"


def lower_linear_weights(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replace every nn.Linear of `model` whose weight is wider than `dtype`; returns how many.
    A tied output head gets its own copy: the embedding stays as it was."""
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.Linear) and child.weight.dtype != dtype:
                swaps.append((parent, name, child))
    for parent, name, child in swaps:
        setattr(parent, name, LowPrecisionLinear(child, dtype))
    return len(swaps)
