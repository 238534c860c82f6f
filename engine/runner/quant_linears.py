"""Linear layers that keep their weights as integer codes on a grid of block scales (and
minimums), multiplied by engine/runner/csrc/quant_matmul.cpp in decode steps: `Int4Linear`
(4-bit codes, Q4_0 / Q4_1 / Q4_K's grids) and `Int8Linear` (int8 codes, Q8_0's grid and the
5- and 6-bit ones). A decode step on a CPU reads every weight once per token, so the bytes
per weight set its floor (docs/decisions/036, 038, 067).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.runner.cpu_extensions import load_extension


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
    """y = x W^T (+ b) with W kept as 4-bit codes per group of inputs: quantized from the
    weights (`min_max_groups`), or a file's own grid (`from_grid`). A forward of at most
    SMALL_M rows multiplies the codes: with engine/runner/csrc/quant_matmul.cpp where it is built,
    else with torch's CPU int4 kernel in bf16. A larger one (prefill) multiplies a copy of the
    same dequantized weights in `gemm_dtype()`."""

    packed: torch.Tensor  # the codes, in torch's CPU int4 kernel's layout
    # the codes (N, K/2) uint8 for quant_matmul: in each block of 32, byte j = q[j] | q[j+16] << 4
    codes: torch.Tensor
    block_scales: torch.Tensor  # (N, K/group) fp32: w = q * scale + min
    block_mins: torch.Tensor  # (N, K/group) fp32, or empty where min = -8 * scale (Q4_0's grid)
    dense: torch.Tensor  # the dequantized weights (N, K) in gemm_dtype()
    bias: torch.nn.Parameter | None

    def __init__(self, linear: torch.nn.Linear, group: int = GROUP) -> None:
        super().__init__()
        weight = linear.weight.detach()
        # quant_matmul and the dense copy keep the scales and minimums in fp32: bf16 ones, as
        # torch's kernel takes them, moved a forward's hidden state by ~2 % (decision 043)
        q, scales, mins = min_max_groups(weight, group)
        self._hold(q, scales, mins, quantize_groups(weight, group), linear.bias)

    @classmethod
    def from_grid(
        cls,
        q: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> Int4Linear:
        """The layer for weights a file holds on a 4-bit grid: w = q * scale + min, q (N, K) in
        0..15, scales and mins (N, K/32) (Q4_0, Q4_1, Q4_K: engine/runner/gguf_grids.py). Its
        kernel product and dense copy multiply those weights; torch's fallback kernel takes
        them with bf16 scales."""
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        q = q.to(torch.int32)
        scale = scales.to(torch.bfloat16)
        zero = (mins + 8 * scale.float()).to(torch.bfloat16)  # torch's: w = (q - 8) s + z
        torch_grid = torch.stack((scale, zero), -1).transpose(0, 1).contiguous()
        scales, mins = scales.float().contiguous(), mins.float().contiguous()
        layer._hold(q, scales, mins, (q, torch_grid), bias)
        if torch.equal(mins, -8 * scales):  # Q4_0: the kernel reads no minimums
            layer.block_mins = mins.new_empty(0)
        return layer

    def _hold(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        torch_grid: tuple[torch.Tensor, torch.Tensor],
        bias: torch.Tensor | None,
    ) -> None:
        """Keep codes q (N, K) with fp32 block scales and mins (N, K/group) for quant_matmul and
        the dense copy, and torch_grid (codes, scales_and_zeros) for torch's kernel."""
        (self.out_features, self.in_features), group = q.shape, q.shape[1] // scales.shape[1]
        self.group = group
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch_grid[0], 1)
        self.register_buffer("packed", packed)
        self.scales_and_zeros = torch.nn.Parameter(torch_grid[1], requires_grad=False)
        blocks = q.reshape(self.out_features, -1, 2, group // 2).to(torch.uint8)
        codes = blocks[:, :, 0] | (blocks[:, :, 1] << 4)  # GROUP = 32: quant_matmul's block
        self.register_buffer("codes", codes.reshape(self.out_features, -1))
        self.register_buffer("block_scales", scales)
        self.register_buffer("block_mins", mins)
        dense = q.reshape(self.out_features, -1, group).float() * scales[..., None]
        dense += mins[..., None]
        self.register_buffer("dense", dense.reshape(q.shape).to(gemm_dtype()))
        self.bias = None if bias is None else frozen_parameter(bias)

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
        if len({(p.in_features, p.group, p.block_mins.numel() == 0) for p in parts}) != 1:
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
        fused.bias = frozen_parameter(torch.cat(biases)) if biases else None
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
            share_rows(parts, "bias", fused.bias)
        return fused


class Int8Linear(torch.nn.Module):
    """y = x W^T (+ b) with W kept as int8 codes and an fp32 scale per block of inputs, and
    optionally an fp32 minimum per block of 32: w = q d (+ m). `Int8Linear(linear)` quantizes
    symmetrically per 32 inputs, Q8_0's grid, so the GGUF's Q8_0 output head is kept as the
    file holds it (the largest single read of a decode step: 49152 x 576 for SmolLM2); inputs
    not a multiple of 32 get one block per row. `from_grid` keeps a file's 5-, 6- and 8-bit
    grids (engine/runner/gguf_grids.py). A forward of at most SMALL_M rows uses quant_matmul.cpp
    where it is built; a larger one multiplies the dense copy where the layer keeps one, else
    dequantizes into gemm_dtype() first."""

    codes: torch.Tensor  # (N, K) int8
    block_scales: torch.Tensor  # (N, K/group) fp32, group 32, 16 (Q6_K) or K
    block_mins: torch.Tensor | None  # (N, K/32) fp32, or None (symmetric)
    dense: torch.Tensor | None  # the dequantized weights (N, K) in gemm_dtype(), if kept
    bias: torch.nn.Parameter | None

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        n, k = linear.out_features, linear.in_features
        group = GROUP if k % GROUP == 0 else k
        weight = linear.weight.detach().float().reshape(n, -1, group)
        scale = weight.abs().amax(-1) / 127
        step = scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        codes = (weight / step).round().clamp(-127, 127).to(torch.int8)
        self._hold(codes.reshape(n, k), scale.contiguous(), None, None, dense=False)

    @classmethod
    def from_grid(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        bias: torch.Tensor | None = None,
        dense: bool = True,
    ) -> Int8Linear:
        """The layer for weights a file holds as codes (N, K) in -128..127 with scales per 32 or
        16 inputs and mins per 32 or None (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0); `dense`: keep a
        dequantized copy for larger forwards (prefill), as Int4Linear does."""
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        mins = None if mins is None else mins.float().contiguous()
        layer._hold(codes.to(torch.int8), scales.float().contiguous(), mins, bias, dense)
        return layer

    def _hold(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        bias: torch.Tensor | None,
        dense: bool,
    ) -> None:
        (self.out_features, self.in_features), self.group = (
            codes.shape,
            codes.shape[1] // scales.shape[1],
        )
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("block_scales", scales)
        self.register_buffer("block_mins", mins)
        self.register_buffer("dense", self.dequantized(gemm_dtype()) if dense else None)
        self.bias = None if bias is None else frozen_parameter(bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.codes.shape
        w = self.codes.reshape(n, -1, self.group).float() * self.block_scales[..., None]
        if self.block_mins is not None:
            w = w.reshape(n, -1, GROUP) + self.block_mins[..., None]
        return w.reshape(n, k).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        product = _int8_product(self) if rows.shape[0] <= SMALL_M else None
        if product is not None:
            y = product(rows)
        elif self.dense is not None:
            y = F.linear(rows.to(self.dense.dtype), self.dense)
        else:
            dtype = gemm_dtype()
            y = F.linear(rows.to(dtype), self.dequantized(dtype))
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        mins = ", minimums per 32" if self.block_mins is not None else ""
        return (
            f"in={self.in_features}, out={self.out_features}, int8, scales per {self.group}{mins}"
        )

    @classmethod
    def fused(cls, parts: list[Int8Linear]) -> Int8Linear | None:
        """The parts' rows in one Int8Linear (see fuse_linears), or None where their blocks,
        minimums or dense copies differ in kind."""
        kinds = {(p.in_features, p.group, p.block_mins is None, p.dense is None) for p in parts}
        if len(kinds) != 1:
            return None
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused.in_features, fused.group = parts[0].in_features, parts[0].group
        fused.out_features = sum(p.out_features for p in parts)
        for name in ("codes", "block_scales", "block_mins", "dense"):
            held = [getattr(p, name) for p in parts]
            fused.register_buffer(name, None if held[0] is None else torch.cat(held))
            start = 0
            for p in parts:  # views of the fused rows: nothing is held twice
                whole = getattr(fused, name)
                if whole is not None:
                    setattr(p, name, whole[start : start + p.out_features])
                start += p.out_features
        biases: list[torch.Tensor] = [p.bias for p in parts if p.bias is not None]  # all or none
        fused.bias = frozen_parameter(torch.cat(biases)) if biases else None
        if fused.bias is not None:
            share_rows(parts, "bias", fused.bias)
        return fused


def small_matmul(
    module: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module's product for at most SMALL_M rows of x, without its casts and reshapes:
    the int4 and int8 kernels take x (rows, in) in any float dtype and give fp32
    (quant_matmul.cpp) or bf16 (torch's), which a decode step may keep
    (engine/runner/decode_step.py); other modules are themselves."""
    if isinstance(module, Int4Linear) and module.bias is None:
        return _int4_product(module)
    if isinstance(module, Int8Linear) and module.bias is None:
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
    """x (rows <= SMALL_M, in) -> x W^T without the bias: quant_matmul.cpp, else torch's int8
    kernel where the scales are per row, else None (the caller dequantizes)."""
    kernels = quant_kernels()
    if kernels is not None and m.group in (GROUP, GROUP // 2):
        q8, codes, scales = kernels.q8_matmul, m.codes, m.block_scales
        mins = m.block_mins if m.block_mins is not None else scales.new_empty(0)
        return lambda x: q8(x.float(), codes, scales, mins)
    if m.group == m.in_features and m.block_mins is None:
        mm8, codes8, scales8 = torch.ops.aten._weight_int8pack_mm, m.codes, m.block_scales
        return lambda x: mm8(x.to(torch.bfloat16), codes8, scales8[:, 0].to(torch.bfloat16))
    return None


def frozen_parameter(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor.detach(), requires_grad=False)


def share_rows(parts: Sequence[torch.nn.Module], name: str, whole: torch.Tensor) -> None:
    """Make each part's `name` (weight or bias) its rows of `whole`, in order: a view."""
    start = 0
    for p in parts:
        rows = getattr(p, name).shape[0]
        setattr(p, name, frozen_parameter(whole[start : start + rows]))
        start += rows
