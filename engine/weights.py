"""Linear layers whose weights are kept, and multiplied, in a lower precision than the model.

A decode step on a CPU reads every weight once per token and little else: SmolLM2's 538 MB of
fp32 linear weights take ~33 ms at this machine's ~16 GB/s, most of a ~40 ms step
(`longserve bench decode_floor`). Halving the bytes (bf16) halves that part; 4-bit weights
(`Int4Linear`) read an eighth. Keeping the rest of the model (embeddings, norms, the KV cache,
memory frames, attention) in fp32 matters: bf16 attention over a 4K-token cache on this CPU was
slower than fp32 (docs/decisions/033, 036).
"""

from __future__ import annotations

from collections.abc import Callable

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


GROUP = 32  # weights per scale and zero: Q4_1's block, so the embedded GGUF's grid is kept
SMALL_M = 8  # rows up to which the int4 kernel beats bf16 GEMM here (decode steps, small batches)


def quantize_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes of weight (N, K), per row and `group` inputs: w ~ (q - 8) s + z,
    q in 0..15. Returns (q (N, K) int32, scales_and_zeros (K/group, N, 2) bf16), q rounded on
    the bf16 grid itself. Q4_1 weights (w = q d + m, every block holding its min and max) come
    back with the same codes."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    low, high = w.amin(-1), w.amax(-1)  # (N, K/group)
    scale = ((high - low) / 15).to(torch.bfloat16)
    zero = (low + 8 * scale.float()).to(torch.bfloat16)
    step = scale.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    q = ((w - zero.float()[..., None]) / step + 8).round().clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), torch.stack((scale, zero), -1).transpose(0, 1).contiguous()


class Int4Linear(torch.nn.Module):
    """y = x W^T (+ b) with W kept in 4-bit groups (`quantize_groups`). A forward of at most
    SMALL_M rows multiplies the codes with torch's CPU int4 kernel in bf16; a larger one
    (prefill) multiplies a bf16 copy of the same dequantized weights with the bf16 GEMM."""

    packed: torch.Tensor  # the codes, in the CPU kernel's layout
    dense: torch.Tensor  # the dequantized weights (N, K) in bf16
    bias: torch.nn.Parameter | None

    def __init__(self, linear: torch.nn.Linear, group: int = GROUP) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = (
            linear.in_features, linear.out_features, group,
        )  # fmt: skip
        q, scales_and_zeros = quantize_groups(linear.weight.detach(), group)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.register_buffer("packed", packed)
        self.scales_and_zeros = torch.nn.Parameter(scales_and_zeros, requires_grad=False)
        sz = scales_and_zeros.float().transpose(0, 1)  # (N, K/group, 2)
        codes = q.reshape(self.out_features, -1, group).float() - 8
        dense = codes * sz[..., :1] + sz[..., 1:]
        self.register_buffer("dense", dense.reshape(q.shape).to(torch.bfloat16))
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if rows.shape[0] <= SMALL_M:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows, self.packed, self.group, self.scales_and_zeros
            )
        else:
            y = F.linear(rows, self.dense)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int4 groups of {self.group}"

    @classmethod
    def fused(cls, parts: list[Int4Linear]) -> Int4Linear | None:
        """The parts' rows in one Int4Linear (see fuse_linears), or None where the packed rows
        of the parts do not concatenate into the kernel's layout for the whole."""
        if len({(p.in_features, p.group) for p in parts}) != 1:
            return None
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused.in_features, fused.group = parts[0].in_features, parts[0].group
        fused.out_features = sum(p.out_features for p in parts)
        fused.register_buffer("packed", torch.cat([p.packed for p in parts]))
        sz = torch.cat([p.scales_and_zeros.detach() for p in parts], 1).contiguous()
        fused.scales_and_zeros = torch.nn.Parameter(sz, requires_grad=False)
        fused.register_buffer("dense", torch.cat([p.dense for p in parts]))
        fused.bias = None
        probe = torch.randn(1, fused.in_features, dtype=torch.bfloat16)
        want = torch.cat([p(probe) for p in parts], -1)
        if not torch.allclose(fused(probe), want, rtol=1e-2, atol=1e-2 * float(want.abs().max())):
            return None  # the CPU layout packs rows in blocks the parts do not fill
        start = 0
        for p in parts:
            p.dense = fused.dense[start : start + p.out_features]
            start += p.out_features
        return fused


class Int8Linear(torch.nn.Module):
    """y = x W^T with W kept as int8 rows and one bf16 scale per row (symmetric). The output
    head under int4: the GGUF keeps it in Q8_0 (8 bits, a scale per 32 weights), and it is the
    largest single read of a decode step (49152 x 576 for SmolLM2). A forward of at most
    SMALL_M rows uses torch's CPU int8 kernel; a larger one dequantizes into bf16 first."""

    codes: torch.Tensor  # (N, K) int8
    scales: torch.Tensor  # (N,) bf16

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        codes = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scale.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if rows.shape[0] <= SMALL_M:
            y = torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)
        else:
            y = F.linear(rows, self.codes.to(torch.bfloat16) * self.scales[:, None])
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 rows"


def small_matmul(
    module: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module's product for at most SMALL_M rows of x, without its casts and reshapes:
    the int4 and int8 kernels take x (rows, in) in any float dtype and give bf16, which a
    decode step may keep (engine/decode_step.py); other modules are themselves."""
    if isinstance(module, Int4Linear) and module.bias is None:
        mm4, packed, group = torch.ops.aten._weight_int4pack_mm_for_cpu, module.packed, module.group
        sz = module.scales_and_zeros
        return lambda x: mm4(x.to(torch.bfloat16), packed, group, sz)
    if isinstance(module, Int8Linear):
        mm8, codes, scales = torch.ops.aten._weight_int8pack_mm, module.codes, module.scales
        return lambda x: mm8(x.to(torch.bfloat16), codes, scales)
    return module


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
    """One bias-free linear whose output is the parts' outputs side by side (q|k|v, gate|up),
    so a decode step makes one call where it made len(parts). The parts keep working and keep
    no copy of their own: their weights become views of the fused rows. Int4 parts whose packed
    rows do not concatenate (the CPU layout packs rows in blocks of 64) come back unfused."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1 or any(getattr(p, "bias", None) is not None for p in parts):
        return _Concat(parts)
    kind = kinds.pop()
    if kind is Int4Linear:
        return Int4Linear.fused(parts) or _Concat(parts)  # type: ignore[arg-type]
    if kind not in (torch.nn.Linear, LowPrecisionLinear):
        return _Concat(parts)
    weights: list[torch.Tensor] = [p.weight.detach() for p in parts]  # type: ignore[operator]
    weight = torch.cat(weights)
    start = 0
    for p, w in zip(parts, weights, strict=True):
        p.weight = torch.nn.Parameter(weight[start : start + w.shape[0]], requires_grad=False)
        start += w.shape[0]
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    if kind is LowPrecisionLinear:  # the same arithmetic: cast in, multiply, cast back
        return LowPrecisionLinear(fused, weight.dtype)
    return fused


class _Concat(torch.nn.Module):
    """The parts called one by one, outputs concatenated (where they cannot be fused)."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], -1)
