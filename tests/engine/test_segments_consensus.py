"""`segments` with select "consensus": who chooses the blocks, and the voting pass.

The selector is driven directly on random block summaries (real buffers, no model) to check
the choice rules; a tiny random Llama checks that a question's tail runs a voting pass first
and that every layer of the real pass then retrieves the same, voted blocks.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from engine.memory.buffers import GrowingBuffer, LayerStore
from engine.memory.config import SegmentsConfig
from engine.memory.segments import SegmentSelector
from engine.memory.session import SessionMemory
from engine.protocol import MemorySpec

from .test_memory_frame import tiny

KV_HEADS, GROUP, HEAD_DIM, BLOCK, BLOCKS = 2, 2, 8, 4, 12
SCALING = HEAD_DIM**-0.5


def selector(select: str, layers: int = 2) -> tuple[SegmentSelector, list[LayerStore]]:
    """k 1, u 0 over BLOCKS random blocks per layer."""
    config = SegmentsConfig(block=BLOCK, k=1, u=0, select=select, tail=8)
    cpu = torch.device("cpu")
    chooser = SegmentSelector(config, layers, KV_HEADS, HEAD_DIM, torch.float32, cpu)
    generator = torch.Generator().manual_seed(1)
    stores = []
    for layer in range(layers):
        keys = torch.randn(KV_HEADS, BLOCKS * BLOCK, HEAD_DIM, generator=generator)
        mem_k = GrowingBuffer(KV_HEADS, HEAD_DIM, torch.float32, cpu)
        mem_k.append(keys)
        for b in range(BLOCKS):
            block = keys[:, b * BLOCK : (b + 1) * BLOCK]
            chooser.on_memory_added(layer, block, block)
        empty = torch.empty(KV_HEADS, 0, HEAD_DIM)
        window = GrowingBuffer(KV_HEADS, HEAD_DIM, torch.float32, cpu)
        stores.append(LayerStore(empty, empty, window, window, mem_k, mem_k))
    return chooser, stores


def queries(seed: int, tokens: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(KV_HEADS, GROUP, tokens, HEAD_DIM, generator=generator) * 3


def chosen_blocks(idx: torch.Tensor) -> list[list[int]]:
    return [sorted({int(t) // BLOCK for t in row if t >= 0}) for row in idx]


def test_consensus_ranks_by_the_sum_over_heads_and_the_layers_so_far():
    q0, q1 = queries(14), queries(15)
    chooser, stores = selector("consensus")
    s0 = chooser.block_scores(0, q0, SCALING)
    s1 = chooser.block_scores(1, q1, SCALING)
    per_head = s0.argmax(dim=1).tolist()
    summed0, summed01 = int(s0.sum(0).argmax()), int((s0.sum(0) + s1.sum(0)).argmax())
    # the data makes the rules disagree, so the test can tell them apart
    assert per_head[0] != per_head[1] and summed0 not in per_head
    assert summed01 not in (summed0, int(s1.sum(0).argmax()))

    layer0 = chosen_blocks(chooser.select(0, q0, stores[0], SCALING))
    layer1 = chosen_blocks(chooser.select(1, q1, stores[1], SCALING))
    assert layer0 == [[summed0]] * KV_HEADS  # one choice for every KV head
    assert layer1 == [[summed01]] * KV_HEADS  # layer 1 ranks by layers 0 and 1 together

    # a new forward (layer 0 again) starts a new sum
    again = chosen_blocks(chooser.select(0, q1, stores[0], SCALING))
    assert again == [[int(chooser.block_scores(0, q1, SCALING).sum(0).argmax())]] * KV_HEADS


def test_head_select_is_cacheformers_per_head_choice():
    q0 = queries(10)
    chooser, stores = selector("head")
    scores = chooser.block_scores(0, q0, SCALING)
    assert chosen_blocks(chooser.select(0, q0, stores[0], SCALING)) == [
        [int(b)] for b in scores.argmax(dim=1)
    ]


def test_a_held_vote_decides_every_layer_and_a_decode_step_carries_the_last_sum():
    chooser, stores = selector("consensus")
    q0, q1 = queries(14), queries(15)
    chooser.select(0, q0, stores[0], SCALING)
    chooser.select(1, q1, stores[1], SCALING)
    s0, s1 = (
        chooser.block_scores(0, q0, SCALING).sum(0),
        chooser.block_scores(1, q1, SCALING).sum(0),
    )
    chooser.on_abort()  # the voting pass is thrown away ...
    chooser.hold_vote()  # ... and its sum decides the next forward
    winner = [[int((s0 + s1).argmax())]] * KV_HEADS
    assert [[int(s0.argmax())]] * KV_HEADS != winner  # layer 0 alone would choose otherwise
    assert chosen_blocks(chooser.select(0, q0, stores[0], SCALING)) == winner
    assert chosen_blocks(chooser.select(1, q1, stores[1], SCALING)) == winner
    chooser.on_commit(5, 0)

    # a decode step's layer 0 ranks by its own scores plus the last forward's whole sum
    step = queries(20, tokens=1)
    own = chooser.block_scores(0, step, SCALING).sum(0)
    expected = [[int((own + s0 + s1).argmax())]] * KV_HEADS
    assert chosen_blocks(chooser.select(0, step, stores[0], SCALING)) == expected
    assert [[int(own.argmax())]] * KV_HEADS != expected  # the carry changed the choice


def test_the_decode_carry_follows_its_blocks_when_fifo_drops_the_oldest():
    """With a capacity m, a commit may drop the oldest blocks after the carry was summed; the
    carry then scores each block where it now sits, not where it sat."""
    chooser, stores = selector("consensus")
    q0, q1 = queries(14), queries(15)
    chooser.select(0, q0, stores[0], SCALING)
    chooser.select(1, q1, stores[1], SCALING)
    s0, s1 = (
        chooser.block_scores(0, q0, SCALING).sum(0),
        chooser.block_scores(1, q1, SCALING).sum(0),
    )
    carried = s0 + s1
    chooser.on_commit(5, 0)
    dropped = 3
    for layer, store in enumerate(stores):  # what Frame.commit does past m
        store.mem_k.drop_front(dropped * BLOCK)
        chooser.on_memory_dropped(layer, dropped * BLOCK)
    step = queries(22, tokens=1)
    own = chooser.block_scores(0, step, SCALING).sum(0)
    assert own.shape[0] == BLOCKS - dropped
    expected = int((own + carried[dropped:]).argmax())
    assert expected != int(
        (own + carried[: BLOCKS - dropped]).argmax()
    )  # the data tells them apart
    assert chosen_blocks(chooser.select(0, step, stores[0], SCALING)) == [[expected]] * KV_HEADS


FRAME = dict(sinks=8, local_window=32, chunk_size=16, block=8, k=2, u=0, tail=8)


def count_forwards(model: LlamaForCausalLM) -> list[int]:
    calls = [0]
    model.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("select", ["consensus", "head"])
def test_a_question_tail_votes_first_then_every_layer_takes_the_vote(select):
    model = tiny("llama", num_hidden_layers=3)
    memory = SessionMemory(model, MemorySpec("segments", dict(FRAME, select=select)))
    document = 20 + torch.randperm(250, generator=torch.Generator().manual_seed(1))
    memory.append(document)  # 250 tokens: 25 blocks in memory, far more than k
    calls = count_forwards(model)
    before = memory.num_tokens

    memory.append(torch.tensor([5, 6, 7, 8, 9]))  # a question: one tail forward
    assert memory.num_tokens == before + 5  # the voting pass commits nothing
    selected = memory._frame.last_selected
    per_layer = [chosen_blocks(selected[layer]) for layer in range(3)]
    if select == "consensus":
        assert calls[0] == 2  # the vote, then the real pass
        assert per_layer[0] == per_layer[1] == per_layer[2]  # the vote decides every layer
        assert per_layer[0][0] == per_layer[0][1]  # ... and every KV head
    else:
        assert calls[0] == 1

    memory.append(torch.tensor([10]))  # a decode step: no vote
    assert calls[0] == (3 if select == "consensus" else 2)


def test_reading_chunks_do_not_vote():
    model = tiny("llama", num_hidden_layers=3)
    memory = SessionMemory(model, MemorySpec("segments", FRAME))
    calls = count_forwards(model)
    memory.append(20 + torch.arange(200))
    # 200 tokens: chunks of 16 and the last 8 (the tail) on their own; only the tail votes,
    # and only once memory holds more than k blocks to choose from (it does by then)
    assert calls[0] == len(memory._chunks(200)) + 1


def test_decode_steps_choose_as_the_torch_path_does(monkeypatch):
    """memory_step.cpp's consensus_step (a decode step's choice in one call) against the torch
    ops it replaces: the same blocks, layer after layer and step after step, and the same carry."""
    import engine.memory.segments as segments

    if segments.step_kernels(queries(0, tokens=1)) is None:
        pytest.skip("no C++ compiler or ninja to build the kernel")
    config = SegmentsConfig(block=BLOCK, k=2, u=1, select="consensus", tail=8)
    runs = []
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(segments, "step_kernels", lambda q: None)
        chooser, stores = selector("consensus", layers=3)
        chooser.config = config
        chosen = []
        for step in range(4):
            for layer in range(3):
                q = queries(100 + 10 * step + layer, tokens=1)
                chosen.append(chosen_blocks(chooser.select(layer, q, stores[layer], SCALING)))
            chooser.on_commit(1, 0)
        runs.append((chosen, chooser._last_sum))
    assert runs[0][0] == runs[1][0]
    assert len({tuple(c[0]) for c in runs[0][0]}) > 1  # the choice moved between steps or layers
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-6, atol=1e-7)


def test_float16_summaries_stay_a_bound():
    """Block maxima held in float16 are rounded up, minima down: the score "bound" never drops
    below the best single-token score of the block."""
    from engine.memory.quantized import rounded_outward

    x = torch.randn(3, 500, 64, generator=torch.Generator().manual_seed(5)) * 7
    up, down = rounded_outward(x, torch.float16, True), rounded_outward(x, torch.float16, False)
    assert up.dtype == down.dtype == torch.float16
    assert bool((up.float() >= x).all()) and bool((down.float() <= x).all())
    assert float((up.float() - x).abs().max()) <= 7 * 4 * 2**-10  # within an ulp or two
    chooser, _ = selector("consensus")
    assert chooser.summaries[0]["max"].data.dtype == torch.float16  # memory_dtype "auto"
