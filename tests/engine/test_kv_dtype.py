"""Plain requests' KV caches in bf16 on a float32 model (EngineConfig.kv_cache_dtype,
engine/kv_cache.py): a decode step attends over the narrow cache with bf16 matmuls and an fp32
softmax, a prefill chunk widens it; batched steps still match unbatched ones, and logits stay
within bf16 rounding of the fp32 cache's. On the tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.generate import KVCacheState, decode_batch
from engine.kv_cache import attend_cache, attend_narrow
from engine.protocol import SamplingParams

from .test_batching import LOGITS_ATOL, TEXTS, prompt_ids

BF16 = torch.bfloat16


def test_narrow_attention_is_sdpa_over_the_rounded_cache():
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 9, 1, 64, generator=g)
    keys, values = (torch.randn(1, 3, 300, 64, generator=g).to(BF16) for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(
        query, keys.float(), values.float(), scale=0.125, enable_gqa=True
    )
    got = attend_narrow(query, keys, values, 0.125)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max() / want.abs().max() < 0.02
    assert torch.equal(attend_cache(query, keys, values, 0.125), got)  # decode takes this path
    chunk = torch.randn(1, 9, 4, 64, generator=g)  # a prefill chunk widens the cache
    wide = attend_cache(chunk, keys.float(), values.float(), 0.125)
    torch.testing.assert_close(attend_cache(chunk, keys, values, 0.125), wide)


def test_bf16_cache_batched_steps_match_unbatched(tiny_loaded):
    model, tok = tiny_loaded.model, tiny_loaded.tokenizer
    single = [KVCacheState(model, kv_dtype=BF16) for _ in TEXTS]
    batched = [KVCacheState(model, kv_dtype=BF16) for _ in TEXTS]
    wide = [KVCacheState(model) for _ in TEXTS]
    for text, a, b, c in zip(TEXTS, single, batched, wide, strict=True):
        for state in (a, b, c):
            state.prefill(prompt_ids(tok, text))
    assert single[0].cache._buffer is not None and single[0].cache._buffer.dtype == BF16
    next_ids = [11, 22, 33, 44]
    for _ in range(3):
        expected = torch.stack([s.step(t) for s, t in zip(single, next_ids, strict=True)])
        got = decode_batch(model, batched, next_ids)
        torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)
        reference = torch.stack([s.step(t) for s, t in zip(wide, next_ids, strict=True)])
        assert (got - reference).abs().max() / reference.abs().max() < 0.05
        next_ids = got.argmax(-1).tolist()


async def test_the_engine_serves_plain_requests_from_a_bf16_cache(make_engine):
    engine = make_engine(kv_cache_dtype="bfloat16")
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    deltas = [d async for d in engine.generate("r", "Once upon a time", sampling)]
    assert deltas[-1].completion_tokens == 6
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="float16")
