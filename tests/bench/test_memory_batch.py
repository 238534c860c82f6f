"""bench/memory_batch.py's floor: a row's cost per added row and the bytes memory holds."""

import math

import torch

from bench.memory_batch import int8_bytes, kv_bytes, per_row, stream_gbps
from engine.memory.quantized import QuantizedBuffer


def test_int8_bytes_are_what_the_quantized_buffers_hold():
    heads, d, block, n = 3, 64, 64, 5 * 64
    keys = QuantizedBuffer(heads, d, block, torch.device("cpu"))
    values = QuantizedBuffer(heads, d, 0, torch.device("cpu"))
    keys.append(torch.randn(heads, n, d))
    values.append(torch.randn(heads, n, d))
    held = sum(
        t.numel() * t.element_size()
        for b in (keys, values)
        for t in (b.codes.view(), b.params.view())
    )
    assert int8_bytes(heads, n, d, block) == held
    assert held < 2 * heads * n * d * 2 * 0.55  # about half of float16's


def test_per_row_is_the_slope_from_the_fewest_to_the_most_rows():
    assert per_row({1: 20.0, 2: 35.0, 8: 125.0}) == 15.0
    assert math.isnan(per_row({4: 50.0}))


def test_stream_bandwidth_is_a_positive_rate():
    assert stream_gbps(megabytes=8, repeats=1) > 0


def test_kv_bytes_are_what_a_plain_cache_of_the_frame_holds():
    """The afresh rows' floor: a KVCache with exactly `tokens` tokens of room, every layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.runner.kv_cache import KVCache

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64)  # fmt: skip
    model = LlamaForCausalLM(config)
    for kv_dtype, dtype in (("float16", torch.float16), ("model", None)):
        cache = KVCache(model, max_tokens=20, dtype=dtype)
        cache.begin(20)
        assert cache.capacity == 20
        assert kv_bytes(model, 20, kv_dtype) == cache.nbytes()
