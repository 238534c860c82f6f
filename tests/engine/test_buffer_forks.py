"""A fork's buffers share their data until a write would touch rows another holder views
(engine/memory/buffers.py): every holder always reads exactly its own rows."""

from __future__ import annotations

import copy
import gc
import random

import pytest
import torch

from engine.memory.buffers import GrowingBuffer, private_copies
from engine.memory.session import SessionMemory
from engine.protocol import MemorySpec

from .test_memory_frame import tiny
from .test_memory_session import SMALL


def rows(start: int, n: int) -> torch.Tensor:
    """(1, n, 2) rows numbered start.. (so any row written over shows)."""
    return torch.arange(start, start + n, dtype=torch.float32)[None, :, None].expand(1, n, 2)


def filled(n: int) -> GrowingBuffer:
    buffer = GrowingBuffer(1, 2, torch.float32, torch.device("cpu"))
    buffer.append(rows(0, n))
    return buffer


def test_a_copy_shares_the_data_and_appends_past_the_original_in_place():
    parent = filled(100)
    fork = copy.deepcopy(parent)
    assert fork.data is parent.data  # no copy of the rows
    fork.append(rows(1000, 5))  # past the parent's rows, within the capacity: in place
    assert fork.data is parent.data
    assert torch.equal(parent.view(), rows(0, 100))
    assert torch.equal(fork.view()[:, 100:], rows(1000, 5))


def test_the_second_writer_into_the_same_rows_takes_its_own_copy():
    parent = filled(100)
    fork = copy.deepcopy(parent)
    fork.append(rows(1000, 5))
    parent.append(rows(2000, 3))  # rows 100-102, which the fork reads: the parent copies
    assert parent.data is not fork.data
    assert torch.equal(fork.view(), torch.cat((rows(0, 100), rows(1000, 5)), 1))
    assert torch.equal(parent.view(), torch.cat((rows(0, 100), rows(2000, 3)), 1))


def test_a_rewound_holder_does_not_write_over_its_copys_rows():
    parent = filled(100)
    fork = copy.deepcopy(parent)
    parent.drop_back(10)  # a rewind: rows 90-99 are still the fork's
    parent.append(rows(5000, 4))
    assert torch.equal(fork.view(), rows(0, 100))
    assert torch.equal(parent.view(), torch.cat((rows(0, 90), rows(5000, 4)), 1))


def test_moving_rows_to_the_front_never_writes_over_a_copys_rows():
    parent = filled(200)
    parent.append(rows(200, 56))  # capacity 256, full
    fork = copy.deepcopy(parent)
    parent.drop_front(250)  # a FIFO memory: the next append would move 6 rows to the front
    parent.append(rows(7000, 10))
    assert torch.equal(fork.view(), rows(0, 256))
    assert torch.equal(parent.view(), torch.cat((rows(250, 6), rows(7000, 10)), 1))


def test_the_rows_appended_after_a_move_to_the_front_never_cover_a_copys_rows():
    parent = filled(256)  # capacity 256, full
    fork = copy.deepcopy(parent)
    fork.drop_front(25)
    fork.drop_back(216)  # the fork reads rows 25-39 only
    parent.drop_front(236)  # 20 rows left at 236-255: the next append moves them to the front
    parent.append(rows(9000, 30))  # rows 0-19 moved, then 20-49 written: over the fork's 25-39
    assert torch.equal(fork.view(), rows(25, 15))
    assert torch.equal(parent.view(), torch.cat((rows(236, 20), rows(9000, 30)), 1))


def test_a_dropped_copy_leaves_the_data_to_the_original():
    parent = filled(100)
    fork = copy.deepcopy(parent)
    fork.append(rows(1000, 5))
    del fork
    gc.collect()
    data = parent.data
    parent.append(rows(2000, 3))  # the fork is gone: rows 100-102 are nobody else's
    assert parent.data is data
    assert torch.equal(parent.view(), torch.cat((rows(0, 100), rows(2000, 3)), 1))


def test_a_private_copy_has_rows_and_room_of_its_own():
    parent = filled(100)
    with private_copies():
        own = copy.deepcopy(parent)
    assert own.data.data_ptr() != parent.data.data_ptr()
    assert own.data.shape == parent.data.shape  # the same room after the rows
    own.append(rows(1000, 5))
    parent.append(rows(2000, 5))
    assert torch.equal(own.view()[:, 100:], rows(1000, 5))
    assert torch.equal(parent.view()[:, 100:], rows(2000, 5))


@pytest.mark.parametrize("seed", range(6))
def test_random_appends_and_drops_on_many_copies_match_private_lists(seed):
    """Every holder reads what a private copy of its own would hold, whatever the order."""
    rng = random.Random(seed)
    buffers, truths, counter = [filled(10)], [list(range(10))], 10_000
    for _ in range(2000):
        i = rng.randrange(len(buffers))
        action = rng.random()
        if action < 0.15 and len(buffers) < 8:
            buffers.append(copy.deepcopy(buffers[i]))
            truths.append(list(truths[i]))
        elif action < 0.25 and len(buffers) > 1:
            buffers.pop(i), truths.pop(i)
        elif action < 0.35:
            n = rng.randrange(0, len(truths[i]) + 1)
            buffers[i].drop_front(n)
            del truths[i][:n]
        elif action < 0.45:
            n = rng.randrange(0, len(truths[i]) + 1)
            buffers[i].drop_back(n)
            del truths[i][len(truths[i]) - n :]
        else:
            n = rng.randrange(1, 40)
            buffers[i].append(rows(counter, n))
            truths[i].extend(range(counter, counter + n))
            counter += n
        for buffer, truth in zip(buffers, truths, strict=True):
            assert buffer.view()[0, :, 0].tolist() == truth


@pytest.mark.parametrize("memory_dtype", ["float16", "int8"])
def test_a_fork_copies_no_memory_and_both_go_on_as_if_alone(memory_dtype):
    torch.manual_seed(0)
    model = tiny("llama")
    spec = MemorySpec("segments", {**SMALL["segments"], "memory_dtype": memory_dtype})
    ids = torch.randint(0, model.config.vocab_size, (400,))
    memory, alone = SessionMemory(model, spec), SessionMemory(model, spec)
    with torch.inference_mode():
        memory.append(ids)
        alone.append(ids)
        fork = memory.fork()
        store = memory._frame.layers[0]
        held = store.mem_v.codes.data if memory_dtype == "int8" else store.mem_v.data
        forked = fork._frame.layers[0]
        assert (forked.mem_v.codes.data if memory_dtype == "int8" else forked.mem_v.data) is held
        more = torch.randint(0, model.config.vocab_size, (120,))  # enough to move blocks
        fork_logits = fork.append(more)
        other = torch.randint(0, model.config.vocab_size, (120,))
        logits = memory.append(other)
        torch.testing.assert_close(logits, alone.append(other), rtol=0, atol=0)
        again = SessionMemory(model, spec)
        again.append(ids)
        torch.testing.assert_close(fork_logits, again.append(more), rtol=0, atol=0)
        own = memory.fork(private=True)._frame.layers[0]
        own_v = own.mem_v.codes.data if memory_dtype == "int8" else own.mem_v.data
        now = store.mem_v.codes.data if memory_dtype == "int8" else store.mem_v.data
        assert own_v.data_ptr() != now.data_ptr()
