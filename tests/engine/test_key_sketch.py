"""tokens' sketch search (engine/memory/key_sketch.py, engine/runner/csrc/token_search.cpp) against an
exact scan of every key."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.memory import key_sketch
from engine.memory.key_sketch import KeySketch, search, search_torch
from engine.memory.ranking import fair_union
from engine.memory.rotary import RotaryTable
from engine.runner.cpu_extensions import load_extension

D = 32
needs_kernel = pytest.mark.skipif(
    load_extension("token_search") is None, reason="no C++ compiler or ninja to build the kernel"
)


def table() -> RotaryTable:
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return RotaryTable(LlamaForCausalLM(config), 256)


def memory(n: int, seed: int) -> tuple[torch.Tensor, KeySketch]:
    """Pre-rotary keys (2, n, D) with a few large dimensions, as model keys have, and the
    sketch over them, grown in pieces as memory grows."""
    g = torch.Generator().manual_seed(seed)
    k_pre = torch.randn(2, n, D, generator=g) * (1 + 4 * torch.rand(D, generator=g))
    sketch = KeySketch(2, D, torch.device("cpu"))
    for part in k_pre.split(64, dim=1):
        sketch.add(part)
    return k_pre, sketch


def exact_rows(queries: torch.Tensor, k_pre: torch.Tensor, k: int) -> list[set[int]]:
    """Each head's first k distinct hits rank by rank over its rows, by an exact scan."""
    scores = queries @ k_pre.transpose(1, 2)  # (kv_heads, R, n)
    return [set(fair_union(s.topk(k).indices, k).tolist()) for s in scores]


def as_sets(rows: torch.Tensor) -> list[set[int]]:
    return [set(r[r >= 0].tolist()) for r in rows]


def test_the_torch_path_ranks_as_an_exact_scan_of_the_sketch():
    _, sketch = memory(640, 0)
    queries = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(1))
    got = search_torch(queries, sketch, 20)
    assert as_sets(got) == exact_rows(queries, sketch.view().float().transpose(1, 2), 20)
    assert all(torch.equal(r[r >= 0], r[r >= 0].sort().values) for r in got)


@needs_kernel
@pytest.mark.parametrize(
    ("n", "rows", "k"), [(3000, 3, 24), (3000, 3, 256), (1000, 5, 24), (70, 4, 24), (33, 1, 24)]
)
def test_the_kernel_ranks_as_the_torch_path(n, rows, k):
    """The kernel's blocks of 64 keys by up to 4 rows, its remainder one key at a time, and its
    sampled bar (n of 4k and more) give each head the rows of sorting every score, for key
    counts that are not multiples of 64 and row counts that are not multiples of 4."""
    rotary = table()
    _, sketch = memory(n, 6)
    queries = torch.randn(2, rows, D, generator=torch.Generator().manual_seed(7))
    k = min(k, n)
    kernel = search(queries, sketch, rotary, k)
    assert as_sets(kernel) == exact_rows(queries, sketch.view().float().transpose(1, 2), k)
    assert torch.equal(kernel, search_torch(queries, sketch, k))


@needs_kernel
@pytest.mark.parametrize("n", [500, 5000])
def test_tied_scores_go_to_the_lower_row_as_in_the_torch_path(n):
    """Keys drawn from four distinct vectors tie in hundreds at every rank: the kernel's sort
    keeps the lower rows among equal scores, as the torch path's stable sort does."""
    g = torch.Generator().manual_seed(8)
    distinct = torch.randn(2, 4, D, generator=g)
    k_pre = distinct[:, torch.randint(0, 4, (n,), generator=g)]
    sketch = KeySketch(2, D, torch.device("cpu"))
    sketch.add(k_pre)
    queries = torch.randn(2, 3, D, generator=g)
    kernel = search(queries, sketch, table(), 64)
    assert torch.equal(kernel, search_torch(queries, sketch, 64))


@pytest.mark.parametrize("use_kernel", [True, False])
def test_planted_near_neighbours_are_found(use_kernel, monkeypatch):
    """Five keys planted close to a head's first query row are that row's top hits, within the
    ranks fair_union keeps for it (k 16 over three rows)."""
    if use_kernel and load_extension("token_search") is None:
        pytest.skip("no kernel")
    if not use_kernel:
        monkeypatch.setattr(key_sketch, "_kernels", lambda *_: None)
    k_pre, _ = memory(3200, 4)
    g = torch.Generator().manual_seed(5)
    queries = torch.randn(2, 3, D, generator=g)
    planted = torch.randperm(k_pre.shape[1], generator=g)[:10].view(2, 5)
    for h in range(2):
        k_pre[h, planted[h]] = 3 * queries[h, 0] + 0.1 * torch.randn(5, D, generator=g)
    sketch = KeySketch(2, D, torch.device("cpu"))
    sketch.add(k_pre)
    rows = search(queries, sketch, table(), 16)
    for h in range(2):
        assert set(planted[h].tolist()) <= set(rows[h].tolist())
    want = exact_rows(queries, k_pre, 16)
    recall = [len(r & w) / len(w) for r, w in zip(as_sets(rows), want, strict=True)]
    assert min(recall) >= 0.9  # float16 keys may reorder near-ties at the k-th rank


def test_drop_front_and_growth_keep_the_rows_current():
    sketch = KeySketch(2, D, torch.device("cpu"))
    k_pre = torch.randn(2, 3000, D, generator=torch.Generator().manual_seed(6))
    for part in k_pre.split(700, dim=1):  # past the first capacity, then doubling
        sketch.add(part)
    sketch.drop_front(1000)
    sketch.add(k_pre[:, :500])
    held = torch.cat((k_pre[:, 1000:], k_pre[:, :500]), dim=1)
    torch.testing.assert_close(sketch.view(), held.transpose(1, 2).half())


def test_a_deep_copy_holds_the_same_keys_apart():
    sketch = KeySketch(2, D, torch.device("cpu"))
    sketch.add(torch.randn(2, 100, D))
    twin = copy.deepcopy(sketch)
    sketch.drop_front(40)
    sketch.add(torch.randn(2, 10, D))
    assert twin.size == 100 and twin.view().shape == (2, D, 100)
    assert not torch.equal(twin.view()[:, :, :60], sketch.view()[:, :, :60])
    assert twin.nbytes() == 2 * D * 100 * 2


@pytest.mark.parametrize("use_kernel", [True, False])
def test_a_position_rotates_the_queries_before_the_search(use_kernel, monkeypatch):
    """A decode step hands its queries as they come and the retrieval distance as `position`:
    the rows are those of the queries rotated by it beforehand."""
    if use_kernel and load_extension("token_search") is None:
        pytest.skip("no kernel")
    if not use_kernel:  # search's own torch path
        monkeypatch.setattr(key_sketch, "_kernels", lambda *_: None)
    rotary = table()
    _, sketch = memory(960, 7)
    queries = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(8))
    rotated = rotary.rotate(queries, torch.tensor([37]))
    assert torch.equal(search(queries, sketch, rotary, 24, 37), search(rotated, sketch, rotary, 24))
