"""A document's end moves it to memory (flush_window), retrieved text runs straight into the
window, and a memory rewinds to its documents' end exactly: a new chat after a rewind gets the
logits of a memory that never saw the old conversation (tiny random models)."""

from __future__ import annotations

import pytest
import torch

from engine.memory.session import SessionMemory
from engine.memory.strategies import STRATEGIES
from engine.protocol import MemorySpec

from .test_memory_frame import ATOL, tiny
from .test_memory_session import SMALL


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_documents_end_moves_its_window_to_memory(strategy):
    memory = SessionMemory(tiny("llama"), MemorySpec(strategy, SMALL[strategy]))
    memory.append(ids(203, 1), document=True)
    frame = memory._frame
    assert frame.memory_used and frame.n_local >= frame.config.block
    before = frame.n_memory
    memory.end_document()
    assert frame.n_local < frame.config.block  # the part block that cannot move yet
    assert frame.n_memory == before + (203 - 8 - before - frame.n_local)
    assert memory.num_tokens == 203


def test_a_document_that_fits_the_frame_stays_in_the_window():
    memory = SessionMemory(tiny("llama"), MemorySpec("segments", SMALL["segments"]))
    memory.append(ids(30, 2), document=True)
    memory.end_document()
    assert memory.memory_tokens == 0 and memory._frame.n_local == 22


def test_the_window_sits_right_after_the_retrieval_budget():
    memory = SessionMemory(tiny("llama"), MemorySpec("segments", SMALL["segments"]))
    memory.append(ids(203, 3), document=True)
    memory.end_document()
    frame, c = memory._frame, memory.config
    positions = frame.begin(4)
    start = c.sinks + c.retrieval_budget
    assert frame._local_positions().tolist() == list(range(start, start + frame.n_local))
    assert positions.tolist() == list(range(start + frame.n_local, start + frame.n_local + 4))
    frame.abort()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_rewound_memory_answers_as_if_the_conversation_never_was(strategy):
    model = tiny("llama")
    spec = MemorySpec(strategy, SMALL[strategy])
    doc, old_turn, question = ids(203, 4), ids(12, 5), ids(9, 6)

    fresh = SessionMemory(model, spec)
    fresh.append(doc, document=True)
    fresh.end_document()
    expected = fresh.append(question)

    memory = SessionMemory(model, spec)
    memory.append(doc, document=True)
    memory.end_document()
    mark = memory.mark()
    memory.append(old_turn)
    for _ in range(3):  # decode steps too
        memory.append(memory.append(ids(0, 0)).argmax()[None])
    assert memory.can_rewind(mark) and memory.rewind(mark)
    assert memory.num_tokens == 203 and memory.state_hash == mark.state_hash
    torch.testing.assert_close(memory.append(question), expected, atol=ATOL, rtol=0)


def test_a_conversation_that_reached_memory_is_not_rewound():
    memory = SessionMemory(tiny("llama"), MemorySpec("segments", SMALL["segments"]))
    memory.append(ids(203, 7), document=True)
    memory.end_document()
    mark = memory.mark()
    memory.append(ids(40, 8))  # past the 32-token window: a block moves to memory
    held = (memory.num_tokens, memory.memory_tokens, memory.state_hash)
    assert not memory.can_rewind(mark) and not memory.rewind(mark)
    assert (memory.num_tokens, memory.memory_tokens, memory.state_hash) == held


def test_a_rewind_forgets_sinks_read_after_the_mark():
    memory = SessionMemory(tiny("llama"), MemorySpec("segments", SMALL["segments"]))
    mark = memory.mark()  # empty: nothing in the sinks yet
    memory.append(ids(5, 9))
    assert memory.rewind(mark)
    assert memory._frame.n_sinks == 0 and memory.num_tokens == 0
    assert memory._frame.layers[0].sink_k.shape[1] == 0
