"""Prefix reuse for prompts that fit the window (engine/caches/kv_prefix.py): a prompt that starts
with an earlier one's whole blocks reads only the rest and answers as read from scratch; tenants
share nothing; the cache keeps its byte bound and one entry per prompt line."""

from __future__ import annotations

import torch

from engine.caches.kv_prefix import KVPrefixCache
from engine.protocol import SamplingParams
from engine.runner.kv_cache import KVCache

ASK = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True)
BLOCK = 64  # the engines' prefill chunk here (the tiny model's window is 256), and the units' block


async def ask(engine, request_id, prompt, tenant="t1"):
    deltas = [d async for d in engine.generate(request_id, prompt, ASK, tenant=tenant)]
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = [lp.logprob for d in deltas for lp in (d.logprobs or [])]
    return tokens, logprobs, deltas[-1]


WORDS = ["river", "stone", "lamp", "orchard", "violet", "copper", "harbor", "meadow"]


def prompt(tail: str) -> str:
    """About 150 tokens every prompt starts with (two whole blocks), then `tail`: the tiny
    model's window is 256."""
    return " ".join(WORDS[(3 * i) % 8] for i in range(140)) + "\n\nQuestion: " + tail


async def test_a_prompt_starting_like_an_earlier_one_reads_only_the_rest(make_engine):
    cached = make_engine(prefill_chunk_tokens=BLOCK)
    plain = make_engine(prefill_chunk_tokens=BLOCK, kv_prefix_cache_bytes=0)
    first = await ask(cached, "a1", prompt("which word is first?"))
    assert first[2].cached_tokens == 0
    second = await ask(cached, "a2", prompt("and the last one?"))
    scratch = await ask(plain, "b2", prompt("and the last one?"))
    assert second[2].cached_tokens == 2 * BLOCK  # the shared ~150 tokens hold two whole blocks
    assert scratch[2].cached_tokens == 0
    assert second[0] == scratch[0]
    assert second[1] == scratch[1]  # the rest read in the same forwards: bit for bit
    stats = cached.stats()
    assert (stats.prefix_cache_hits, stats.prefix_cache_misses) == (1, 1)
    assert stats.prefix_cache_tokens_reused == 2 * BLOCK and stats.prefix_cache_entries == 1


async def test_tenants_share_nothing(make_engine):
    engine = make_engine(prefill_chunk_tokens=BLOCK)
    await ask(engine, "a", prompt("how many words?"), tenant="alice")
    other = await ask(engine, "b", prompt("how many words?"), tenant="mallory")
    again = await ask(engine, "c", prompt("how many words?"), tenant="alice")
    assert other[2].cached_tokens == 0 and again[2].cached_tokens == 2 * BLOCK
    assert other[0] == again[0]


def filled(model, tokens: int, seed: int) -> KVCache:
    """A cache holding `tokens` tokens of random keys and values."""
    cache = KVCache(model, 4096)
    shape = (cache.num_layers, 2, cache.kv_heads, tokens, cache.head_dim)
    cache.start_from(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def test_the_longest_kept_prefix_is_copied_whole_blocks_at_a_time(tiny_loaded):
    model = tiny_loaded.model
    kept = KVPrefixCache(1 << 30, BLOCK)
    ids = torch.arange(5 * BLOCK + 7) % 200
    source = filled(model, len(ids), 0)
    kept.keep("t", ids, source)
    # the same first 3 blocks and a bit, then other tokens: 3 blocks come back
    other = torch.cat((ids[: 3 * BLOCK + 5], torch.full((40,), 201)))
    fresh = KVCache(model, 4096)
    assert kept.start("t", other, fresh) == 3 * BLOCK
    torch.testing.assert_close(fresh.prefix(3 * BLOCK), source.prefix(3 * BLOCK))
    # the whole prompt again: every whole block but one token is left to read
    exact = ids[: 4 * BLOCK]
    assert kept.start("t", exact, KVCache(model, 4096)) == 3 * BLOCK
    assert kept.start("t", torch.full((300,), 9), KVCache(model, 4096)) == 0
    assert kept.start("u", ids, KVCache(model, 4096)) == 0  # another scope


def test_a_longer_prompt_replaces_the_entry_it_begins_with(tiny_loaded):
    model = tiny_loaded.model
    kept = KVPrefixCache(1 << 30, BLOCK)
    ids = torch.arange(4 * BLOCK) % 200
    kept.keep("t", ids[: 2 * BLOCK], filled(model, 2 * BLOCK, 0))
    kept.keep("t", ids, filled(model, 4 * BLOCK, 1))
    kept.keep("t", ids[: 3 * BLOCK], filled(model, 3 * BLOCK, 2))  # held already: kept once
    stats = kept.stats()
    assert stats.entries == 1
    assert kept.start("t", ids[: 2 * BLOCK + 1], KVCache(model, 4096)) == 2 * BLOCK


def test_bytes_stay_within_the_bound(tiny_loaded):
    model = tiny_loaded.model
    one = filled(model, BLOCK, 0).prefix(BLOCK)
    per_entry = one.numel() * one.element_size()
    kept = KVPrefixCache(2 * per_entry, BLOCK)
    for seed in range(5):
        ids = torch.full((BLOCK,), seed)
        kept.keep("t", ids, filled(model, BLOCK, seed))
    stats = kept.stats()
    assert stats.bytes <= 2 * per_entry and stats.entries == 2 and stats.evictions == 3
    # the newest stay; the oldest are gone
    assert kept.start("t", torch.full((BLOCK + 1,), 4), KVCache(model, 4096)) == BLOCK
    assert kept.start("t", torch.full((BLOCK + 1,), 0), KVCache(model, 4096)) == 0
    # a prompt larger than the whole bound is not kept
    small = KVPrefixCache(per_entry, BLOCK)
    small.keep("t", torch.arange(2 * BLOCK), filled(model, 2 * BLOCK, 9))
    assert small.stats().entries == 0 and small.stats().bytes == 0
