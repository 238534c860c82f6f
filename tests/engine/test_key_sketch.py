"""tokens' sketch search (engine/memory/key_sketch.py, engine/csrc/token_search.cpp) against an
exact scan of every key."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.cpu_extensions import load_extension
from engine.memory import key_sketch
from engine.memory.key_sketch import KeySketch, search, search_torch
from engine.memory.rotary import RotaryTable
from engine.memory.tokens import fair_union

BLOCK, D = 16, 32
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


def memory(n: int, seed: int, rotary: RotaryTable, block_local: bool, dtype=torch.float16):
    """Pre-rotary keys (2, n, D) with a few large dimensions, as model keys have; the sketch
    over them, and the frame's copy of them (rotated by their offset in their block)."""
    g = torch.Generator().manual_seed(seed)
    k_pre = torch.randn(2, n, D, generator=g) * (1 + 4 * torch.rand(D, generator=g))
    sketch = KeySketch(2, D, torch.device("cpu"))
    for part in k_pre.split(4 * BLOCK, dim=1):  # grown in pieces, as memory grows
        sketch.add(part)
    stored = k_pre
    if block_local:
        stored = rotary.rotate(k_pre, torch.arange(n) % BLOCK)
    return k_pre, sketch, stored.to(dtype)


def exact_rows(queries: torch.Tensor, k_pre: torch.Tensor, k: int) -> list[set[int]]:
    """Each head's first k distinct hits rank by rank over its rows, by an exact scan."""
    scores = queries @ k_pre.transpose(1, 2)  # (kv_heads, R, n)
    return [set(fair_union(s.topk(k).indices, k).tolist()) for s in scores]


@pytest.mark.parametrize("block_local", [True, False])
def test_every_key_scored_exactly_agrees_with_a_plain_scan(block_local):
    rotary = table()
    k_pre, sketch, stored = memory(40 * BLOCK, 0, rotary, block_local, torch.float32)
    queries = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(1))
    want = exact_rows(queries, k_pre, 20)
    got = search_torch(queries, sketch, stored, rotary, block_local, 20, BLOCK, D, 0)
    assert [set(r[r >= 0].tolist()) for r in got] == want
    if load_extension("token_search") is not None:
        kernel = search(queries, sketch, stored, rotary, block_local, 20, BLOCK, D, 0)
        assert torch.equal(kernel, got)


@needs_kernel
@pytest.mark.parametrize(("n", "rows"), [(1000, 5), (70, 4), (33, 1)])
def test_the_exact_scan_ranks_as_a_plain_scan_of_the_sketch(n, rows):
    """The default search (candidates 0) scores every key from the float16 sketch: the kernel's
    blocks of 64 keys by up to 4 rows, its remainder one key at a time, and its sampled bar give
    each head the same rows as sorting every score, for key counts that are not multiples of
    64 and row counts that are not multiples of 4."""
    rotary = table()
    k_pre, sketch, stored = memory(n, 6, rotary, True)
    queries = torch.randn(2, rows, D, generator=torch.Generator().manual_seed(7))
    k = min(24, n)
    kernel = search(queries, sketch, stored, rotary, True, k, BLOCK, 8, 0)
    want = exact_rows(queries, sketch.view().float().transpose(1, 2), k)
    assert [set(r[r >= 0].tolist()) for r in kernel] == want
    assert torch.equal(kernel, search_torch(queries, sketch, stored, rotary, True, k, BLOCK, 8, n))


@needs_kernel
@pytest.mark.parametrize("block_local", [True, False])
def test_kernel_and_torch_agree_with_the_sketch(block_local):
    """Partial scores on 8 of 32 dimensions, 200 candidates of 1600 keys: the kernel thresholds
    a sample where torch takes the exact top 200, so they may differ at the margin only."""
    rotary = table()
    _, sketch, stored = memory(100 * BLOCK, 2, rotary, block_local)
    queries = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(3))
    kernel = search(queries, sketch, stored, rotary, block_local, 32, BLOCK, 8, 200)
    torch_rows = search_torch(queries, sketch, stored, rotary, block_local, 32, BLOCK, 8, 200)
    for a, b in zip(kernel, torch_rows, strict=True):
        assert len(set(a.tolist()) & set(b.tolist())) >= 0.9 * 32
        assert torch.equal(a, a.sort().values)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_planted_near_neighbours_are_found_through_the_sketch(use_kernel):
    """Five keys planted close to a head's first query row are that row's top hits, within the
    ranks fair_union keeps for it (k 16 over three rows); the sketch must bring them all to the
    exact stage."""
    if use_kernel and load_extension("token_search") is None:
        pytest.skip("no kernel")
    rotary = table()
    k_pre, _, _ = memory(200 * BLOCK, 4, rotary, True)
    g = torch.Generator().manual_seed(5)
    queries = torch.randn(2, 3, D, generator=g)
    planted = torch.randperm(k_pre.shape[1], generator=g)[:10].view(2, 5)
    for h in range(2):
        k_pre[h, planted[h]] = 3 * queries[h, 0] + 0.1 * torch.randn(5, D, generator=g)
    sketch = KeySketch(2, D, torch.device("cpu"))
    sketch.add(k_pre)
    stored = rotary.rotate(k_pre, torch.arange(k_pre.shape[1]) % BLOCK).half()
    find = search if use_kernel else search_torch
    rows = find(queries, sketch, stored, rotary, True, 16, BLOCK, 8, 256)
    for h in range(2):
        assert set(planted[h].tolist()) <= set(rows[h].tolist())
    recall = [
        len(set(r.tolist()) & w) / len(w)
        for r, w in zip(rows, exact_rows(queries, k_pre, 16), strict=True)
    ]
    assert min(recall) >= 0.9


def test_drop_front_and_growth_keep_rows_and_rms_current():
    sketch = KeySketch(2, D, torch.device("cpu"))
    k_pre = torch.randn(2, 3000, D, generator=torch.Generator().manual_seed(6))
    for part in k_pre.split(700, dim=1):  # past the first capacity, then doubling
        sketch.add(part)
    sketch.drop_front(1000)
    sketch.add(k_pre[:, :500])
    held = torch.cat((k_pre[:, 1000:], k_pre[:, :500]), dim=1)
    torch.testing.assert_close(sketch.view(), held.transpose(1, 2).half())
    torch.testing.assert_close(sketch.rms(), held.square().mean(1).sqrt(), rtol=1e-4, atol=1e-5)


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
    _, sketch, stored = memory(60 * BLOCK, 7, rotary, True)
    queries = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(8))
    rotated = rotary.rotate(queries, torch.tensor([37]))
    want = search(rotated, sketch, stored, rotary, True, 24, BLOCK, 8, 300)
    got = search(queries, sketch, stored, rotary, True, 24, BLOCK, 8, 300, 37)
    assert torch.equal(got, want)
