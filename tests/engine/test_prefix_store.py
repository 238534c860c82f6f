"""Long prompts' prefix memories through the memory store (engine/caches/prefix_store.py): two
LocalEngines on one embedded store stand for two replicas, their own prefix caches off. A
prompt on the second replica imports the chunks the first one wrote and answers as a third
engine (its own store) that reads the same prompt from scratch with write-through: the same
greedy tokens, logprobs within 1e-4 (both hold the same fp16 encodings; the rest is read in
the same chunks). Tenants share nothing; reuse stops at the chunk where prompts diverge; a
store that is down fails no request."""

from __future__ import annotations

import socket

import pytest

from engine.runner.chat_template import encode_chat

from .test_prefix_cache import FRAME, SPECS, ask, assert_same_answer, chat, document

CHUNK = FRAME["chunk_size"]


@pytest.fixture
def replicas(make_engine, tmp_path):
    """make(n, store=...) -> n engines with prefix write-through on one embedded store."""

    def make(n: int = 2, store: str = "shared", **config):
        options = {"prefix_cache_store": True, "prefix_cache_bytes": 0, **config}
        data = str(tmp_path / store)
        return [make_engine(data_dir=data, **options) for _ in range(n)]

    return make


def whole_chunks_before_document_end(tokenizer, messages) -> int:
    """What a prompt can import: its whole chunks ending before the question's tail (32)."""
    body = len(encode_chat(tokenizer, messages)) - 32
    return (body - 1) // CHUNK * CHUNK


@pytest.mark.parametrize("strategy", list(SPECS))
async def test_another_replica_answers_as_read_from_scratch(replicas, tokenizer, strategy):
    spec = SPECS[strategy]
    first, second = replicas(2)
    (scratch,) = replicas(1, store="own")
    doc = document(11)
    one = await ask(first, "a1", chat(doc, "Which word comes first?"), spec)
    assert one[2].cached_tokens == 0
    written = first.stats().prefix_cache_store_chunks_written
    assert written >= one[2].prompt_tokens // CHUNK - 1

    question = chat(doc, "And which one is the last?")
    got = await ask(second, "b1", question, spec)
    want = await ask(scratch, "c1", question, spec)
    assert_same_answer(got, want)
    imported = got[2].cached_tokens
    assert imported == whole_chunks_before_document_end(tokenizer, question) > 0
    stats = second.stats()
    assert (stats.prefix_cache_store_hits, stats.prefix_cache_store_tokens_imported) == (
        1,
        imported,
    )
    assert stats.prefix_cache_store_chunks_written == 0  # every whole chunk was there already
    assert want[2].cached_tokens == 0


async def test_tenants_never_share_a_stored_memory(replicas):
    spec = SPECS["segments"]
    first, second = replicas(2)
    doc = document(12)
    await ask(first, "a", chat(doc, "First?"), spec, tenant="alice")
    bob = await ask(second, "b", chat(doc, "Second?"), spec, tenant="bob")
    assert bob[2].cached_tokens == 0 and second.stats().prefix_cache_store_hits == 0
    alice = await ask(second, "c", chat(doc, "Second?"), spec, tenant="alice")
    assert alice[2].cached_tokens > 0
    assert_same_answer(alice, bob)


async def test_import_stops_at_the_chunk_where_prompts_diverge(replicas, tokenizer):
    spec = SPECS["segments"]
    first, second = replicas(2)
    (scratch,) = replicas(1, store="own")
    doc = document(13)
    await ask(first, "a", chat(doc, "Which word comes first?"), spec)
    words = doc.split()
    words[150] = "zeppelin"
    changed = chat(" ".join(words), "Which word comes first?")
    got = await ask(second, "b", changed, spec)
    ids, original = encode_chat(tokenizer, changed), encode_chat(tokenizer, chat(doc, "q"))
    first_diff = next(i for i, (a, b) in enumerate(zip(ids, original, strict=False)) if a != b)
    assert got[2].cached_tokens == first_diff // CHUNK * CHUNK > 0
    assert_same_answer(got, await ask(scratch, "c", changed, spec))


async def test_a_store_that_is_down_fails_no_request(make_engine, replicas):
    spec, doc = SPECS["segments"], document(14)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = make_engine(
        memory_store_url=f"http://127.0.0.1:{port}",
        memory_store_timeout_s=2.0,
        prefix_cache_store=True,
        prefix_cache_bytes=0,
    )
    (scratch,) = replicas(1, store="own")
    question = chat(doc, "First?")
    got = await ask(down, "a", question, spec)
    assert got[2].cached_tokens == 0
    assert down.stats().prefix_cache_store_failures >= 1
    assert_same_answer(got, await ask(scratch, "b", question, spec))
