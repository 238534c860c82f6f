"""engine/runner/csrc/memory_step.cpp against the torch ops it replaces in a memory decode step."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.memory.rotary import RotaryTable
from engine.runner.cpu_extensions import load_extension

pytestmark = pytest.mark.skipif(
    load_extension("memory_step") is None, reason="no C++ compiler or ninja to build the kernel"
)


def table(rope: dict | None = None) -> RotaryTable:
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_scaling=rope,
    )
    return RotaryTable(LlamaForCausalLM(config), 256)


@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 2.0}])
def test_step_queries_undo_and_redo_the_rotations_as_the_table_does(rope):
    """The pre-rotary query and key, and both at their window position, equal RotaryTable's
    unrotate and rotate (a yarn table scales cos and sin: undoing divides by the scale twice)."""
    rotary = table(rope)
    kernels = load_extension("memory_step")
    g = torch.Generator().manual_seed(0)
    query, key = torch.randn(4, 16, generator=g), torch.randn(2, 16, generator=g)
    frame_pos, window_pos = torch.tensor([200]), torch.tensor([37])
    q_pre, k_pre, q_window, k_window = kernels.step_queries(
        query, key, rotary.cos, rotary.sin, 200, 37, rotary.scale_sq
    )
    want_q = rotary.unrotate(query[:, None], frame_pos)  # (H, 1, d)
    torch.testing.assert_close(q_pre, want_q.view(2, 2, 16), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        k_pre, rotary.unrotate(key[:, None], frame_pos), rtol=1e-5, atol=1e-6
    )
    want_window = rotary.rotate(want_q, window_pos).view(2, 1, 2, 16)
    torch.testing.assert_close(q_window, want_window, rtol=1e-5, atol=1e-6)
    want_k = rotary.rotate(rotary.unrotate(key[:, None], frame_pos), window_pos)
    torch.testing.assert_close(k_window, want_k, rtol=1e-5, atol=1e-6)


def test_block_queries_rotate_once_per_block_at_its_distance():
    rotary = table()
    kernels = load_extension("memory_step")
    q_pre = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
    got = kernels.block_queries(q_pre, rotary.cos, rotary.sin, 100, 5, 8)  # (2, 5, 3, 16)
    for j in range(5):
        want = rotary.rotate(q_pre.reshape(6, 1, 16), torch.tensor([100 - 8 * j]))
        torch.testing.assert_close(got[:, j], want.view(2, 3, 16), rtol=1e-5, atol=1e-6)


def test_positions_outside_the_table_are_refused():
    rotary = table()
    kernels = load_extension("memory_step")
    q, k = torch.randn(4, 16), torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        kernels.step_queries(q, k, rotary.cos, rotary.sin, 256, 0, 1.0)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        kernels.block_queries(q.view(2, 2, 16), rotary.cos, rotary.sin, 20, 4, 8)  # 20 - 24 < 0
    with pytest.raises(RuntimeError, match="query"):
        kernels.step_queries(q, torch.randn(3, 16), rotary.cos, rotary.sin, 0, 0, 1.0)


@pytest.mark.parametrize("blocks", [1, 7, 1500])  # 1500: split over threads
@pytest.mark.parametrize("score", ["bound", "mean"])
def test_block_scores_are_the_softmax_mean_over_the_group(score, blocks):
    """segments.py's formula: the bound sum_i max(q_i hi_i, q_i lo_i) (or q . mean), a softmax
    over blocks per query head, averaged over the heads of each KV group; summaries read
    through a strided view, as a GrowingBuffer's."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 64, generator=g)
    high = torch.randn(3, blocks + 9, 64, generator=g)[:, :blocks]  # rows contiguous, strided
    low = high - torch.rand(3, blocks + 9, 64, generator=g)[:, :blocks]
    if score == "mean":
        logits = q @ high.transpose(1, 2)
        got = load_extension("memory_step").block_scores(q, high, torch.empty(0), 0.125)
    else:
        logits = q.clamp(min=0) @ high.transpose(1, 2) + q.clamp(max=0) @ low.transpose(1, 2)
        got = load_extension("memory_step").block_scores(q, high, low, 0.125)
    want = (logits * 0.125).softmax(dim=-1).mean(dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("rows", "whole", "padded"),
    [
        ([[8, 9, 10, 11, 0, 1, 2, 3]], True, False),  # two whole blocks of 4, any order
        ([[8, 9, 10, 11, -1, -1, -1, -1]], True, True),  # a padded block
        ([[8, 9, -1, -1, 4, 5, 6, 7]], True, True),  # a block cut short by padding
        ([[9, 10, 11, 12, 0, 1, 2, 3]], False, False),  # not at a block's start
        ([[8, 9, 11, 10, 0, 1, 2, 3]], False, False),  # out of order
        ([[-1, 9, 10, 11, 0, 1, 2, 3]], False, True),  # padding before the block's rows
        ([[0, 1, 2, 3, 4, 5]], False, False),  # not whole runs of 4
        ([[0, 1, 2, 3], [-1, -1, -1, -1]], True, True),  # per KV head
    ],
)
def test_whole_blocks_agrees_with_the_frames_torch_check(rows, whole, padded):
    from engine.memory.config import FrameConfig
    from engine.memory.frame import Frame
    from engine.memory.selector import Selector

    idx = torch.tensor(rows)
    assert load_extension("memory_step").whole_blocks(idx, 4) == (whole, padded)
    frame = Frame(
        FrameConfig(block=4),
        Selector(),
        table(),
        1,
        len(rows),
        16,
        torch.float32,
        torch.device("cpu"),
    )
    ok = idx >= 0
    assert frame.reader.whole_blocks(idx, ok) == whole and bool((~ok).any()) == padded


@pytest.mark.parametrize("carry_blocks", [None, 5, 40])  # no carry, a shorter one, a longer one
@pytest.mark.parametrize("score", ["bound", "mean"])
def test_consensus_step_is_segments_torch_choice(score, carry_blocks):
    """The running sum (over KV heads, added to the layers' sum so far) and the blocks chosen:
    top k of the sum plus the carry (cut or zero-padded), u neighbours each side, clamped."""
    g = torch.Generator().manual_seed(3)
    blocks, k, u = 23, 4, 1
    q = torch.randn(3, 4, 64, generator=g)
    high = torch.randn(3, blocks + 5, 64, generator=g)[:, :blocks]
    low = (
        high - torch.rand(3, blocks + 5, 64, generator=g)[:, :blocks] if score == "bound" else None
    )
    none = torch.empty(0)
    kernels = load_extension("memory_step")
    scores = kernels.block_scores(q, high, none if low is None else low, 0.125).sum(0)
    before = torch.rand(blocks, generator=g)
    carry = None if carry_blocks is None else torch.rand(carry_blocks, generator=g)
    for running in (None, before):
        got_sum, got_blocks, got_rows = kernels.consensus_step(
            q, high, none if low is None else low, 0.125,
            none if running is None else running, none if carry is None else carry, k, u, 8,
        )  # fmt: skip
        want_sum = scores if running is None else running + scores
        torch.testing.assert_close(got_sum, want_sum, rtol=1e-6, atol=1e-7)
        rank = want_sum.clone()
        if carry is not None:
            n = min(blocks, carry_blocks)
            rank[:n] += carry[:n]
        best = rank.topk(k).indices.tolist()
        want = sorted({min(max(b + o, 0), blocks - 1) for b in best for o in range(-u, u + 1)})
        assert got_blocks == want
        rows = [b * 8 + j for b in want for j in range(8)]
        assert got_rows.tolist() == [rows] * 3


def test_consensus_step_refuses_a_running_sum_of_another_length():
    kernels = load_extension("memory_step")
    q, high = torch.randn(2, 2, 16), torch.randn(2, 6, 16)
    with pytest.raises(RuntimeError, match="one score per block"):
        kernels.consensus_step(
            q, high, torch.empty(0), 0.25, torch.zeros(5), torch.empty(0), 2, 0, 4
        )


@pytest.mark.parametrize("score", ["bound", "mean"])
def test_float16_summaries_score_as_their_float32_values(score):
    """Summaries held in float16 (memory_dtype "auto") are widened as read: the scores of
    their exact float32 values."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 4, 64, generator=g)
    high = torch.randn(3, 700, 64, generator=g).half()
    low = (high.float() - torch.rand(3, 700, 64, generator=g)).half()
    none = torch.empty(0)
    kernels = load_extension("memory_step")
    lows = (low, low.float()) if score == "bound" else (none, none)
    got = kernels.block_scores(q, high, lows[0], 0.125)
    want = kernels.block_scores(q, high.float(), lows[1], 0.125)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)


def test_a_negative_position_rotates_backwards():
    """A retrieved row's frame slot is negative with fewer sinks than a block: rotating by -p
    undoes rotating by p, as the model's rotation would place it p before slot 0."""
    rotary = table()
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(2))
    p = torch.tensor([1, 3, 7, 30, 0])
    torch.testing.assert_close(rotary.rotate(rotary.rotate(x, p), -p), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotary.rotate(x, -p), rotary.unrotate(x, p), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("held", [torch.float32, torch.float16])
def test_gather_rotated_is_take_then_rotate(held):
    """Memory rows gathered from a buffer's strided view (rows from its start), widened and
    rotated at their positions: what GrowingBuffer.take and RotaryTable.rotate give."""
    from engine.memory.buffers import GrowingBuffer

    rotary = table()
    g = torch.Generator().manual_seed(6)
    buffer = GrowingBuffer(2, 16, held, torch.device("cpu"))
    buffer.append(torch.randn(2, 40, 16, generator=g))
    buffer.drop_front(7)  # a view that does not start at the data's first row
    values = GrowingBuffer(2, 16, held, torch.device("cpu"))
    values.append(torch.randn(2, 40, 16, generator=g))
    values.drop_front(7)
    rows = torch.randint(0, 33, (2, 9), generator=g)
    positions = torch.randint(-8, 256, (2, 9), generator=g)  # negative: rotated backwards
    keys, vals = load_extension("memory_step").gather_rotated(
        buffer.view(), values.view(), rows, positions, rotary.cos, rotary.sin
    )
    want = rotary.rotate(buffer.take(rows).float(), positions)
    torch.testing.assert_close(keys, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(vals, values.take(rows).float())
    with pytest.raises(RuntimeError, match="outside the memory"):
        load_extension("memory_step").gather_rotated(
            buffer.view(), values.view(), rows + 33, positions, rotary.cos, rotary.sin
        )
