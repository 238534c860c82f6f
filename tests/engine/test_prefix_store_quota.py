"""Prefix-store entries bounded per tenant across replicas (engine/caches/prefix_store.py,
memory_store/usage.py): two LocalEngines on one embedded store; each chunk written is counted
in the tenant's ledger first, and past the bound the prompt is answered without writing."""

from __future__ import annotations

from memory_store.client import embedded_client

from .test_prefix_cache import SPECS, ask, chat, document


async def test_prefix_entries_stop_at_the_tenant_bound_on_every_replica(make_engine, tmp_path):
    spec = SPECS["segments"]
    options = {"prefix_cache_store": True, "prefix_cache_bytes": 0}
    data = str(tmp_path / "store")
    first, second = (
        make_engine(data_dir=data, prefix_store_max_entries_per_tenant=2, **options)
        for _ in range(2)
    )
    one = await ask(first, "a", chat(document(21), "First?"), spec, tenant="alice")
    assert one[2].finish_reason is not None and one[2].prompt_tokens > 256  # answered
    assert first.stats().prefix_cache_store_chunks_written == 2  # of 6 whole chunks

    # Another document on the other replica: alice has no room left there either.
    two = await ask(second, "b", chat(document(22), "First?"), spec, tenant="alice")
    assert two[2].finish_reason is not None
    assert second.stats().prefix_cache_store_chunks_written == 0
    # bob's bound is his own.
    await ask(second, "c", chat(document(22), "First?"), spec, tenant="bob")
    assert second.stats().prefix_cache_store_chunks_written == 2

    store = embedded_client(tmp_path / "store" / "memory-store")  # where the engines keep it
    try:
        assert (await store.usage("alice"))["prefix_entries"] == 2
        assert (await store.usage("bob"))["prefix_entries"] == 2
    finally:
        await store.close()
