"""Prefix reuse for long prompts (engine/caches/prefix_cache.py), through LocalEngine on the tiny random
Llama: a prompt that starts with an earlier one's chunks answers exactly as read from scratch
(same greedy tokens, logprobs within 1e-4: the kept memory is a copy and the rest is read in the
same chunks, but the copy's buffers are compacted, so float32 reductions over them may run in
another order: 1e-5 apart measured), whatever the strategy; reuse stops at the chunk where prompts diverge; eviction
never touches a request under way; tenants share nothing."""

from __future__ import annotations

import random

import pytest

from engine.protocol import MemorySpec, SamplingParams
from engine.runner.chat_template import encode_chat

# chunks longer than the question's tail: reading a document does not retrieve
FRAME = {"sinks": 8, "local_window": 32, "chunk_size": 64, "block": 16, "prior_k": 2, "prior_u": 0}
SPECS = {
    "segments": MemorySpec("segments", {**FRAME, "k": 2, "u": 1}),
    "tokens": MemorySpec("tokens", {**FRAME, "k": 16, "index": "torch"}),
    "neurocache": MemorySpec(
        "neurocache", {**FRAME, "k": 4, "w": 2, "c": 2, "r": 0, "fit_tokens": 32, "d": 8}
    ),
}
ASK = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
LOGPROB_ATOL = 1e-4

WORDS = [
    "river",
    "stone",
    "lamp",
    "orchard",
    "violet",
    "copper",
    "harbor",
    "meadow",
    "lantern",
    "cedar",
    "quill",
    "ember",
]


def document(seed: int, words: int = 420) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def chat(doc: str, question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{doc}\n\n{question}"}]


async def ask(engine, request_id, prompt, spec, tenant="t1", sampling=ASK):
    deltas = [
        d async for d in engine.generate(request_id, prompt, sampling, memory=spec, tenant=tenant)
    ]
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = [lp.logprob for d in deltas for lp in (d.logprobs or [])]
    return tokens, logprobs, deltas[-1]


def assert_same_answer(got, want):
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_ATOL)


@pytest.mark.parametrize("strategy", list(SPECS))
async def test_a_reused_prefix_answers_as_read_from_scratch(make_engine, strategy):
    spec = SPECS[strategy]
    cached, plain = make_engine(), make_engine(prefix_cache_bytes=0)
    doc = document(1)
    first = await ask(cached, "a1", chat(doc, "Which word comes first?"), spec)
    assert first[2].cached_tokens == 0 and first[2].prompt_tokens > 256  # the memory path
    second = await ask(cached, "a2", chat(doc, "And which one is the last?"), spec)
    scratch = await ask(plain, "b2", chat(doc, "And which one is the last?"), spec)
    assert_same_answer(second, scratch)
    reused = second[2].cached_tokens
    assert reused > 0 and reused % FRAME["chunk_size"] == 0
    assert reused >= second[2].prompt_tokens - 256 - 2 * FRAME["chunk_size"] - 40
    stats = cached.stats()
    assert (stats.prefix_cache_hits, stats.prefix_cache_misses) == (1, 1)
    assert stats.prefix_cache_tokens_reused == reused and stats.prefix_cache_entries >= 1
    assert plain.stats().prefix_cache_entries == 0 and scratch[2].cached_tokens == 0


async def test_a_conversation_resent_each_turn_reuses_the_last_turn(make_engine):
    spec, engine, plain = SPECS["segments"], make_engine(), make_engine(prefix_cache_bytes=0)
    turns = chat(document(2), "Name a word from the text.")
    _, _, first = await ask(engine, "t1", turns, spec)
    turns = [*turns, {"role": "assistant", "content": "lamp"}, {"role": "user", "content": "Why?"}]
    second = await ask(engine, "t2", turns, spec)
    assert second[2].cached_tokens > 0
    assert_same_answer(second, await ask(plain, "p2", turns, spec))


async def test_reuse_stops_at_the_chunk_where_prompts_diverge(make_engine, tokenizer):
    spec, engine, plain = SPECS["segments"], make_engine(), make_engine(prefix_cache_bytes=0)
    doc = document(3)
    await ask(engine, "d1", chat(doc, "Which word comes first?"), spec)
    words = doc.split()
    words[150] = "zeppelin"  # inside the text the kept memory read
    changed = " ".join(words)
    got = await ask(engine, "d2", chat(changed, "Which word comes first?"), spec)
    ids, original = (
        encode_chat(tokenizer, chat(changed, "q")),
        encode_chat(tokenizer, chat(doc, "q")),
    )
    first_diff = next(i for i, (a, b) in enumerate(zip(ids, original, strict=False)) if a != b)
    chunk = FRAME["chunk_size"]
    assert got[2].cached_tokens == first_diff // chunk * chunk > 0
    assert_same_answer(got, await ask(plain, "p", chat(changed, "Which word comes first?"), spec))


async def test_eviction_never_touches_a_request_under_way(make_engine):
    spec = SPECS["segments"]
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True)
    doc_a, doc_b = document(4), document(5)
    probe = make_engine()
    await ask(probe, "size", chat(doc_a, "Hi?"), spec)
    one_entry = probe.stats().prefix_cache_bytes  # room for one kept memory, not two
    engine, plain = make_engine(prefix_cache_bytes=one_entry + 1), make_engine(prefix_cache_bytes=0)
    await ask(engine, "a1", chat(doc_a, "Hi?"), spec)
    stream = engine.generate("a2", chat(doc_a, "More?"), long, memory=spec, tenant="t1")
    head = [await anext(stream)]  # a2 forked the kept memory and is decoding
    assert head[0].cached_tokens > 0
    await ask(engine, "b1", chat(doc_b, "Hi?"), spec)  # its copy evicts doc_a's
    rest = [d async for d in stream]
    stats = engine.stats()
    assert stats.prefix_cache_evictions >= 1 and stats.prefix_cache_entries == 1
    deltas = head + rest
    got = (
        [t for d in deltas for t in d.token_ids],
        [lp.logprob for d in deltas for lp in d.logprobs],
    )
    assert_same_answer(got, await ask(plain, "p", chat(doc_a, "More?"), spec, sampling=long))
    again = await ask(engine, "a3", chat(doc_a, "Hi?"), spec)
    assert again[2].cached_tokens == 0  # doc_a's copy is gone


async def test_tenants_never_share_a_kept_memory(make_engine):
    spec, engine = SPECS["segments"], make_engine()
    doc = document(6)
    await ask(engine, "a", chat(doc, "First?"), spec, tenant="alice")
    bob = await ask(engine, "b", chat(doc, "Second?"), spec, tenant="bob")
    assert bob[2].cached_tokens == 0
    alice = await ask(engine, "c", chat(doc, "Second?"), spec, tenant="alice")
    assert alice[2].cached_tokens > 0
    assert_same_answer(alice, bob)  # same answer, only alice's was reused


async def test_a_different_memory_configuration_reuses_nothing(make_engine):
    engine, doc = make_engine(), document(7)
    await ask(engine, "a", chat(doc, "First?"), SPECS["segments"])
    other = MemorySpec("segments", {**FRAME, "k": 1, "u": 1})
    got = await ask(engine, "b", chat(doc, "First?"), other)
    assert got[2].cached_tokens == 0


async def test_short_prompts_and_a_zero_budget_keep_nothing(make_engine):
    engine = make_engine(prefix_cache_bytes=0)
    spec, doc = SPECS["segments"], document(8)
    for request_id in ("a", "b"):
        got = await ask(engine, request_id, chat(doc, "First?"), spec)
        assert got[2].cached_tokens == 0
    short = await ask(make_engine(), "s", chat("A short note.", "Hi?"), spec)
    assert short[2].cached_tokens == 0 and short[2].stats.strategy is None


async def test_a_memory_that_retrieves_by_the_question_while_reading_is_not_kept(make_engine):
    # chunks no longer than the tail retrieve while reading, with the question's EmbQ: what
    # the memory keeps of the document depends on the question, so no other question reuses it
    engine, doc = make_engine(), document(9)
    spec = MemorySpec("segments", {**FRAME, "chunk_size": 32, "k": 2, "u": 1})
    for request_id in ("a", "b"):
        got = await ask(engine, request_id, chat(doc, "First?"), spec)
        assert got[2].cached_tokens == 0
    assert engine.stats().prefix_cache_entries == 0
