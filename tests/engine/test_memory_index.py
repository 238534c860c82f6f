"""Index backends agree with exact search on random data."""

from __future__ import annotations

import pytest
import torch

from engine.memory.index import VectorIndex


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("backend", ["faiss-flat", "faiss-hnsw", "faiss-ivf"])
def test_backends_return_the_exact_top_k(backend, metric):
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(4000, 32, generator=gen)
    queries = torch.randn(20, 32, generator=gen)
    exact = VectorIndex(32, "torch", metric)
    other = VectorIndex(32, backend, metric)
    for part in data.split(1000):  # grown in pieces, as memory grows
        exact.add(part)
        other.add(part)
    other.set_search_effort(nprobe=10_000, ef_search=2000)
    want_scores, want_ids = exact.search(queries, 10)
    got_scores, got_ids = other.search(queries, 10)
    recall = sum(
        len(set(a.tolist()) & set(b.tolist())) for a, b in zip(want_ids, got_ids, strict=True)
    )
    assert recall / want_ids.numel() >= (1.0 if backend != "faiss-hnsw" else 0.97)
    torch.testing.assert_close(got_scores[:, 0], want_scores[:, 0], atol=1e-3, rtol=1e-4)


def test_drop_front_shifts_ids_and_auto_switches_backend():
    gen = torch.Generator().manual_seed(1)
    data = torch.randn(300, 16, generator=gen)
    index = VectorIndex(16, "auto", "ip", threshold=200)
    index.add(data[:100])
    assert index.current_backend() == "torch"
    index.add(data[100:])
    assert index.current_backend() == "faiss-hnsw"
    index.drop_front(100)
    assert index.ntotal == 200
    _, ids = index.search(data[150:151], 1)
    assert ids.item() == 50  # vector 150 is now id 50


def test_past_the_auto_threshold_the_graph_is_built_as_vectors_arrive():
    """The HNSW graph is built by the add that crosses the threshold and kept current by
    later adds, so the first search after a long document does not pay for building it."""
    gen = torch.Generator().manual_seed(2)
    data = torch.randn(300, 16, generator=gen)
    index = VectorIndex(16, "auto", "ip", threshold=200)
    index.add(data[:150])
    assert index._faiss is None  # exact torch scan below the threshold: nothing to build
    index.add(data[150:250])
    assert index._faiss is not None and index._faiss.ntotal == 250
    index.add(data[250:])
    assert index._faiss.ntotal == 300
    _, ids = index.search(data[280:281], 1)
    assert ids.item() == 280


def test_search_of_an_empty_index_returns_nothing():
    index = VectorIndex(8, "faiss-flat")
    scores, ids = index.search(torch.randn(3, 8), 5)
    assert scores.shape == (3, 0) and ids.shape == (3, 0)


def test_torch_l2_search_keeps_its_norms_through_growth_drops_and_copies():
    """The torch backend's L2 scores come from norms kept as vectors are added: they stay the
    negative squared distances through growth, a FIFO drop, a deep copy and a move."""
    import copy

    gen = torch.Generator().manual_seed(2)
    data, queries = torch.randn(3000, 24, generator=gen), torch.randn(5, 24, generator=gen)
    index = VectorIndex(24, "torch", "l2")
    for part in data.split(700):  # past the first capacity, so the buffers grow
        index.add(part)
    index.drop_front(400)
    twin = copy.deepcopy(index)
    twin.to("cpu")
    want = -torch.cdist(queries, data[400:]).square()
    for held in (index, twin):
        scores, ids = held.search(queries, 7)
        assert torch.equal(ids, want.topk(7, dim=-1).indices)
        torch.testing.assert_close(scores, want.gather(1, ids), atol=1e-3, rtol=1e-5)
