"""engine/runner/csrc/quant_matmul.cpp: 4-bit block codes and int8 rows times a few float rows."""

from __future__ import annotations

import pytest
import torch

from engine.runner.quant_linears import Int4Linear, Int8Linear, quant_kernels, small_matmul
from engine.runner.weights import fuse_linears

pytestmark = pytest.mark.skipif(
    quant_kernels() is None, reason="no C++ compiler or ninja to build the kernel"
)


def int4_layer(n: int, k: int, seed: int = 0) -> Int4Linear:
    g = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=False)
    linear.weight.data = torch.randn(n, k, generator=g) * 0.02
    return Int4Linear(linear)


def dequantized(layer: Int4Linear) -> torch.Tensor:
    """The layer's weights (N, K) in fp32 from its codes, block scales and minimums: what the
    kernel multiplies (layer.dense is rounded to bf16 where gemm_dtype() is bf16)."""
    n, k = layer.out_features, layer.in_features
    codes = torch.stack((layer.codes & 15, layer.codes >> 4), 2)  # (N, K/2, 2) low, high
    q = codes.view(n, k // 32, 16, 2).permute(0, 1, 3, 2).reshape(n, k).float()  # k order
    scales, mins = (t.repeat_interleave(32, 1) for t in (layer.block_scales, layer.block_mins))
    return q * scales + mins


def test_every_code_position_reaches_its_input():
    """A one-hot input quantizes exactly (its block's scale is 1/32767), so y = q d + m of the
    code at that input: the nibble layout, the block scales and the minimums, exactly."""
    layer = int4_layer(16, 64)
    kernels = quant_kernels()
    dense = dequantized(layer)
    for j in range(64):
        x = torch.zeros(1, 64)
        x[0, j] = 1.0
        y = kernels.q4_matmul(x, layer.codes, layer.block_scales, layer.block_mins)
        torch.testing.assert_close(y[0], dense[:, j], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dense, layer.dense.float(), rtol=0, atol=1e-2 * 0.02)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_q4_matches_the_dequantized_product(rows):
    """Int16 activations per block of 32: within 1e-3 of the output's norm (measured 3-7e-5),
    every row of a batch the same as alone."""
    layer = int4_layer(208, 96)
    x = torch.randn(rows, 96)
    want = x @ dequantized(layer).t()
    got = small_matmul(layer)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 208)
    assert float((got - want).norm() / want.norm()) < 1e-3
    alone = torch.cat([small_matmul(layer)(x[r : r + 1]) for r in range(rows)])
    torch.testing.assert_close(got, alone, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_q8_head_matches_the_dequantized_product(rows):
    linear = torch.nn.Linear(64, 300, bias=False)
    linear.weight.data.normal_(0, 0.02)
    head = Int8Linear(linear)
    x = torch.randn(rows, 64)
    want = x @ head.dequantized(torch.float32).t()
    got = head(x)
    assert float((got - want).norm() / want.norm()) < 1e-3
    x = torch.zeros(1, 64)
    x[0, 37] = 1.0  # one-hot: exact, with the scale of the second block of 32
    want = head.codes[:, 37].float() * head.block_scales[:, 1]
    torch.testing.assert_close(head(x)[0], want, rtol=1e-6, atol=0)


def test_q8_0_weights_are_kept_as_the_file_holds_them():
    """Weights on Q8_0's grid (a scale per 32, codes in -127..127 with one at +-127 per block)
    dequantize back to themselves."""
    torch.manual_seed(0)
    codes = torch.randint(-127, 128, (40, 96))
    codes[:, ::32] = 127
    scales = torch.rand(40, 3) * 0.01
    weight = (codes.reshape(40, 3, 32) * scales[..., None]).reshape(40, 96)
    linear = torch.nn.Linear(96, 40, bias=False)
    linear.weight.data.copy_(weight)
    head = Int8Linear(linear)
    torch.testing.assert_close(head.dequantized(torch.float32), weight, rtol=1e-6, atol=0)


def test_fused_parts_are_views_and_multiply_as_before():
    parts = [int4_layer(64, 64, seed) for seed in range(3)]
    x = torch.randn(2, 64)
    want = torch.cat([p(x) for p in parts], -1)
    fused = fuse_linears(parts)
    assert isinstance(fused, Int4Linear)
    torch.testing.assert_close(fused(x), want, rtol=0, atol=0)
    assert parts[1].codes.data_ptr() == fused.codes[64:].data_ptr()
    torch.testing.assert_close(torch.cat([p(x) for p in parts], -1), want, rtol=0, atol=0)


def test_bad_shapes_are_refused():
    layer = int4_layer(32, 64)
    kernels = quant_kernels()
    with pytest.raises(RuntimeError, match="x: "):
        kernels.q4_matmul(torch.randn(1, 32), layer.codes, layer.block_scales, layer.block_mins)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        kernels.q4_matmul(torch.randn(17, 64), layer.codes, layer.block_scales, layer.block_mins)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.q4_matmul(
            torch.randn(1, 64).double(), layer.codes, layer.block_scales, layer.block_mins
        )
