"""Linear layers whose weights are kept, and multiplied, in a lower precision than the model.

A decode step on a CPU reads every weight once per token and little else: SmolLM2's 538 MB of
fp32 linear weights take ~33 ms at this machine's ~16 GB/s, most of a ~40 ms step
(`longserve bench decode_floor`). Halving the bytes (bf16) halves that part; 4-bit weights
(`Int4Linear`, engine/runner/quant_linears.py) read an eighth. Keeping the rest of the model
(embeddings, norms, the KV cache, memory frames, attention) in fp32 matters: bf16 attention
over a 4K-token cache on this CPU was slower than fp32 (docs/decisions/033, 036).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.runner.quant_linears import (
    GROUP,
    Int4Linear,
    Int8Linear,
    frozen_parameter,
    share_rows,
)


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


def lower_linear_weights(model: torch.nn.Module, dtype: torch.dtype | str) -> int:
    """Replace every nn.Linear of `model` whose weight is wider than `dtype`; returns how many.
    A tied output head gets its own copy: the embedding stays as it was. dtype "int4": the
    layers' weights go to 4-bit groups (Int4Linear, CPU only), the output head to int8 rows
    (Int8Linear), any layer whose inputs do not split into groups to bf16."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.Linear) and child.weight.dtype != dtype:
                swaps.append((parent, name, child))
    for parent, name, child in swaps:
        if dtype != "int4":
            setattr(parent, name, LowPrecisionLinear(child, dtype))  # type: ignore[arg-type]
        elif child is head and child.bias is None:
            setattr(parent, name, Int8Linear(child))
        elif child.in_features % GROUP:
            setattr(parent, name, LowPrecisionLinear(child, torch.bfloat16))
        else:
            setattr(parent, name, Int4Linear(child))
    return len(swaps)


def fuse_linears(parts: list[torch.nn.Module]) -> torch.nn.Module:
    """One linear whose output is the parts' outputs side by side (q|k|v, gate|up), with the
    parts' biases side by side where every part has one (Qwen2's q, k and v), so a decode step
    makes one call where it made len(parts). The parts keep working and keep no copy of their
    own: their weights and biases become views of the fused rows. Parts of different kinds,
    some biased and some not, or int4 parts whose packed rows do not concatenate (the CPU
    layout packs rows in blocks of 64) come back unfused."""
    kinds = {type(p) for p in parts}
    biases = [getattr(p, "bias", None) for p in parts]
    if len(kinds) != 1 or len({b is None for b in biases}) != 1:
        return _Concat(parts)
    kind = kinds.pop()
    if kind is Int4Linear:
        return Int4Linear.fused(parts) or _Concat(parts)  # type: ignore[arg-type]
    if kind is Int8Linear:
        return Int8Linear.fused(parts) or _Concat(parts)  # type: ignore[arg-type]
    if kind not in (torch.nn.Linear, LowPrecisionLinear):
        return _Concat(parts)
    weight = torch.cat([p.weight.detach() for p in parts])  # type: ignore[operator]
    share_rows(parts, "weight", weight)
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = frozen_parameter(weight)
    if biases[0] is not None:
        fused.bias = frozen_parameter(torch.cat([b for b in biases if b is not None]))
        share_rows(parts, "bias", fused.bias)
    if kind is LowPrecisionLinear:  # the same arithmetic: cast in, multiply, cast back, add
        return LowPrecisionLinear(fused, weight.dtype)
    return fused


class _Concat(torch.nn.Module):
    """The parts called one by one, outputs concatenated (where they cannot be fused)."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], -1)
