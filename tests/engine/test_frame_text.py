"""answer_read "afresh" (engine/sessions/frame_text.py): a question's answer generated over its
frame's tokens read again in a plain cache, the session still reading every token.

On the tiny random model: which tokens make the frame, that the answer is the plain cache's
over them, that memory ends holding what it would have held, and that a session that fits is
answered exactly as before. Whether it answers better is `bench recall`'s business
(docs/decisions/076-answer-read-afresh.md)."""

from __future__ import annotations

import pytest
import torch

from engine.memory.config import parse_memory_spec
from engine.memory.session import SessionMemory
from engine.protocol import InvalidRequest, MemorySpec, SamplingParams
from engine.runner.decode_state import KVCacheState
from engine.sessions.frame_text import FrameTextState
from engine.sessions.memory_state import MemoryState
from tests.engine.test_text_prior import WordEncoder, words

SPEC = {"sinks": 8, "local_window": 64, "chunk_size": 32, "block": 16, "k": 1, "u": 0}
SPEC |= {"prior_k": 1, "prior_u": 0, "contrast": 0.0}  # the plain read; test_contrast.py adds alpha


def _memory(model, doc_len: int, seed: int = 0) -> tuple[SessionMemory, torch.Tensor]:
    memory = SessionMemory(model, MemorySpec("segments", SPEC))
    memory.attach_prior(WordEncoder(), words)
    doc = torch.randint(100, 5000, (doc_len,), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        memory.append(doc, document=True)
        memory.end_document()
    return memory, doc


def test_the_frame_ids_are_sinks_retrieved_rows_and_window(tiny_loaded):
    memory, doc = _memory(tiny_loaded.model, 300)
    memory.set_query(f"t{int(doc[150])}")
    question = torch.tensor([11, 12, 13, 14])
    memory.forget_selection()
    assert memory.frame_ids() is None  # nothing retrieved yet
    with torch.inference_mode():
        memory.append(question)
    ids = memory.frame_ids()
    assert ids is not None
    rows = memory._frame.last_selected[max(memory._frame.last_selected)][0]
    rows = rows[rows >= 0].tolist()
    assert ids[:8] == doc[:8].tolist()
    assert ids[8 : 8 + len(rows)] == [int(doc[8 + r]) for r in rows]
    assert ids[-4:] == question.tolist()
    assert int(doc[150]) in ids  # the prior's block
    assert len(ids) < 300


def test_the_answer_is_the_plain_cache_s_and_memory_reads_it_after(tiny_loaded):
    model = tiny_loaded.model
    memory, doc = _memory(model, 300)
    twin = memory.fork()
    memory.set_query(f"t{int(doc[150])}")
    state = FrameTextState(MemoryState(memory, "segments"), model, "model")
    question = torch.tensor([11, 12, 13, 14])
    with torch.inference_mode():
        logits = state.prefill(question)
        ids = memory.frame_ids()
        assert ids is not None
        plain = KVCacheState(model)
        torch.testing.assert_close(logits, plain.prefill(torch.tensor(ids)))
        answer = [int(logits.argmax())]
        for _ in range(3):
            logits = state.step(answer[-1])
            torch.testing.assert_close(logits, plain.step(answer[-1]))
            answer.append(int(logits.argmax()))
        assert state.num_tokens == memory.num_tokens + 3  # three steps owed to memory
        state.flush()
        assert memory.num_tokens == 300 + 4 + 3
        twin.append(torch.tensor([11, 12, 13, 14, *answer[:3]]))
    assert twin.num_tokens == memory.num_tokens
    assert twin.prior is not None and memory.prior is not None
    assert twin.prior.token_ids().tolist() == memory.prior.token_ids().tolist()


def test_a_session_that_fits_answers_as_memory_does(tiny_loaded):
    model = tiny_loaded.model
    memory, _ = _memory(model, 40)  # sinks + window hold it all: nothing retrieves
    twin = memory.fork()
    state = FrameTextState(MemoryState(memory, "segments"), model, "model")
    with torch.inference_mode():
        a = state.prefill(torch.tensor([11, 12, 13]))
        b = twin.append(torch.tensor([11, 12, 13]))
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(state.step(5), twin.append(torch.tensor([5])))
    state.flush()
    assert memory.num_tokens == twin.num_tokens


def test_answer_read_is_checked():
    spec = MemorySpec("segments", {"answer_read": "memory"})
    assert parse_memory_spec(spec, max_positions=8192).answer_read == "memory"
    assert parse_memory_spec(MemorySpec("segments"), max_positions=8192).answer_read == "afresh"
    with pytest.raises(InvalidRequest, match="answer_read"):
        parse_memory_spec(MemorySpec("segments", {"answer_read": "text"}), max_positions=8192)


async def held_after_a_question(engine, name: str, knobs: dict) -> int:
    """Tokens a new session (SPEC and knobs) holds after a document and a 4-token answer."""
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    await engine.create_session(name, MemorySpec("segments", {**SPEC, **knobs}))
    text = " ".join(f"line {i} of the log." for i in range(120))
    [p async for p in engine.ingest(f"d-{name}", name, text)]
    question = [{"role": "user", "content": "Which line?"}]
    deltas = [d async for d in engine.generate(name, question, sampling, session_id=name)]
    assert deltas[-1].completion_tokens == 4
    return engine._frame_backend.conversations[name].memory.num_tokens


async def test_a_session_answers_afresh_and_keeps_the_turn(make_engine):
    engine = make_engine()
    if engine._frame_backend.encoder is None:
        pytest.skip("no sentence encoder installed: the frame's token ids are not kept")
    memory = await held_after_a_question(engine, "memory", {"answer_read": "memory"})
    afresh = await held_after_a_question(engine, "afresh", {"answer_read": "afresh"})
    assert afresh == memory  # the same question and answer length, read whole
