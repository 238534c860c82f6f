"""Linear layers whose weights are kept, and multiplied, in a lower precision than the model.

A decode step on a CPU reads every weight once per token and little else: SmolLM2's 538 MB of
fp32 linear weights take ~33 ms at this machine's ~16 GB/s, most of a ~40 ms step
(`longserve bench decode_floor`). Halving the bytes (bf16) halves that part; 4-bit weights
(`Int4Linear`) read an eighth. Keeping the rest of the model (embeddings, norms, the KV cache,
memory frames, attention) in fp32 matters: bf16 attention over a 4K-token cache on this CPU was
slower than fp32 (docs/decisions/033, 036).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.runner.cpu_extensions import load_extension


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


@functools.cache
def gemm_dtype() -> torch.dtype:
    """The dtype of the dense weight copies that prefill multiplies: bf16 where the CPU
    multiplies it natively (AMX, AVX512-BF16), else fp32. Without native bf16, oneDNN emulates
    it, and a bf16 GEMM ran 4-5x slower than fp32 (an AVX2 EPYC, docs/decisions/038)."""
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


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


def min_max_groups(
    weight: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit codes of weight (N, K) per row and `group` inputs with fp32 block scales and
    minimums: w ~ q * scale + min, q in 0..15, min the block's least weight. Returns (q (N, K)
    int32, scale (N, K/group), min (N, K/group)). Q4_1 weights (w = q d + m, fp16 d and m, every
    block holding codes 0 and 15) come back as the file holds them, up to fp32 rounding of d."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    low, high = w.amin(-1), w.amax(-1)
    scale = (high - low) / 15
    step = scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    q = ((w - low[..., None]) / step).round().clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scale.contiguous(), low.contiguous()


def quant_kernels() -> Any | None:
    """engine/runner/csrc/quant_matmul.cpp (int16 activations, integer dot products), or None."""
    return load_extension("quant_matmul")


class Int4Linear(torch.nn.Module):
    """y = x W^T (+ b) with W kept in 4-bit groups (`quantize_groups`). A forward of at most
    SMALL_M rows multiplies the codes: with engine/runner/csrc/quant_matmul.cpp where it is built,
    else with torch's CPU int4 kernel in bf16. A larger one (prefill) multiplies a copy of the
    same dequantized weights in `gemm_dtype()`."""

    packed: torch.Tensor  # the codes, in torch's CPU int4 kernel's layout
    # the codes (N, K/2) uint8 for quant_matmul: in each block of 32, byte j = q[j] | q[j+16] << 4
    codes: torch.Tensor
    block_scales: torch.Tensor  # (N, K/group) fp32: w = q * scale + min
    block_mins: torch.Tensor
    dense: torch.Tensor  # the dequantized weights (N, K) in gemm_dtype()
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
        # quant_matmul and the dense copy keep the scales and minimums in fp32: bf16 ones, as
        # torch's kernel takes them, moved a forward's hidden state by ~2 % (decision 043)
        q, scales, mins = min_max_groups(linear.weight.detach(), group)
        blocks = q.reshape(self.out_features, -1, 2, group // 2).to(torch.uint8)
        codes = blocks[:, :, 0] | (blocks[:, :, 1] << 4)  # GROUP = 32: quant_matmul's block
        self.register_buffer("codes", codes.reshape(self.out_features, -1))
        self.register_buffer("block_scales", scales)
        self.register_buffer("block_mins", mins)
        dense = q.reshape(self.out_features, -1, group).float() * scales[..., None]
        dense += mins[..., None]
        self.register_buffer("dense", dense.reshape(q.shape).to(gemm_dtype()))
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= SMALL_M:
            y = _int4_product(self)(rows)
        else:
            y = F.linear(rows.to(self.dense.dtype), self.dense)
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
        for name in ("codes", "block_scales", "block_mins", "dense"):
            fused.register_buffer(name, torch.cat([getattr(p, name) for p in parts]))
        biases: list[torch.Tensor] = [p.bias for p in parts if p.bias is not None]  # all or none
        fused.bias = _parameter(torch.cat(biases)) if biases else None
        probe = torch.randn(1, fused.in_features, dtype=torch.bfloat16)
        want = torch.cat([p(probe) for p in parts], -1)
        if not torch.allclose(fused(probe), want, rtol=1e-2, atol=1e-2 * float(want.abs().max())):
            return None  # the CPU layout packs rows in blocks the parts do not fill
        start = 0
        for p in parts:  # views of the fused rows: nothing is held twice
            for name in ("codes", "block_scales", "block_mins", "dense"):
                setattr(p, name, getattr(fused, name)[start : start + p.out_features])
            start += p.out_features
        if fused.bias is not None:
            _share(parts, "bias", fused.bias)
        return fused


class Int8Linear(torch.nn.Module):
    """y = x W^T with W kept as int8 codes and an fp32 scale per block of 32 inputs (symmetric,
    w = q d): Q8_0's grid, so the GGUF's Q8_0 output head is kept as the file holds it. It is
    the largest single read of a decode step (49152 x 576 for SmolLM2). A forward of at most
    SMALL_M rows uses quant_matmul.cpp where it is built; a larger one, or one without the
    kernel, dequantizes into gemm_dtype() first. Inputs not a multiple of 32: one block per
    row."""

    codes: torch.Tensor  # (N, K) int8
    block_scales: torch.Tensor  # (N, K/group) fp32

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        k = self.in_features
        self.group = GROUP if k % GROUP == 0 else k
        weight = linear.weight.detach().float().reshape(self.out_features, -1, self.group)
        scale = weight.abs().amax(-1) / 127
        step = scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        codes = (weight / step).round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("codes", codes.reshape(self.out_features, k))
        self.register_buffer("block_scales", scale.contiguous())

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        blocks = self.codes.reshape(self.out_features, -1, self.group).to(dtype)
        return (blocks * self.block_scales[..., None].to(dtype)).reshape(self.codes.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        product = _int8_product(self) if rows.shape[0] <= SMALL_M else None
        if product is not None:
            y = product(rows)
        else:
            dtype = gemm_dtype()
            y = F.linear(rows.to(dtype), self.dequantized(dtype))
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 rows"


def small_matmul(
    module: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module's product for at most SMALL_M rows of x, without its casts and reshapes:
    the int4 and int8 kernels take x (rows, in) in any float dtype and give fp32
    (quant_matmul.cpp) or bf16 (torch's), which a decode step may keep
    (engine/runner/decode_step.py); other modules are themselves."""
    if isinstance(module, Int4Linear) and module.bias is None:
        return _int4_product(module)
    if isinstance(module, Int8Linear):
        return _int8_product(module) or module
    return module


def _int4_product(m: Int4Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """x (rows <= SMALL_M, in) -> x W^T without the bias: quant_matmul.cpp, else torch's."""
    kernels = quant_kernels()
    if kernels is not None:
        q4, codes, scales, mins = kernels.q4_matmul, m.codes, m.block_scales, m.block_mins
        return lambda x: q4(x.float(), codes, scales, mins)
    mm4, packed, group, sz = (
        torch.ops.aten._weight_int4pack_mm_for_cpu, m.packed, m.group, m.scales_and_zeros,
    )  # fmt: skip
    return lambda x: mm4(x.to(torch.bfloat16), packed, group, sz)


def _int8_product(m: Int8Linear) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x (rows <= SMALL_M, in) -> x W^T: quant_matmul.cpp, else torch's int8 kernel where the
    scales are per row, else None (the caller dequantizes)."""
    kernels = quant_kernels()
    if kernels is not None and m.group == GROUP:
        q8, codes, scales = kernels.q8_matmul, m.codes, m.block_scales
        return lambda x: q8(x.float(), codes, scales)
    if m.group == m.in_features:
        mm8, codes8, scales8 = torch.ops.aten._weight_int8pack_mm, m.codes, m.block_scales
        return lambda x: mm8(x.to(torch.bfloat16), codes8, scales8[:, 0].to(torch.bfloat16))
    return None


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
    if kind not in (torch.nn.Linear, LowPrecisionLinear):
        return _Concat(parts)
    weight = torch.cat([p.weight.detach() for p in parts])  # type: ignore[operator]
    _share(parts, "weight", weight)
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = _parameter(weight)
    if biases[0] is not None:
        fused.bias = _parameter(torch.cat([b for b in biases if b is not None]))
        _share(parts, "bias", fused.bias)
    if kind is LowPrecisionLinear:  # the same arithmetic: cast in, multiply, cast back, add
        return LowPrecisionLinear(fused, weight.dtype)
    return fused


def _parameter(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor.detach(), requires_grad=False)


def _share(parts: Sequence[torch.nn.Module], name: str, whole: torch.Tensor) -> None:
    """Make each part's `name` (weight or bias) its rows of `whole`, in order: a view."""
    start = 0
    for p in parts:
        rows = getattr(p, name).shape[0]
        setattr(p, name, _parameter(whole[start : start + rows]))
        start += rows


class _Concat(torch.nn.Module):
    """The parts called one by one, outputs concatenated (where they cannot be fused)."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], -1)
