"""A session's turns go out with their last delta (`SessionTurn`) and rebuild the same memory
on another engine: after the same documents, importing the turns leaves every layer's keys and
values equal bit for bit, with no model forward, and the next question gets the same greedy
answer. On the tiny random Llama, for every strategy."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.protocol import InvalidRequest, MemoryBudgetExceeded, SamplingParams
from tests.engine.helpers import SPECS

ANSWER = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DOCUMENT = " ".join(f"Fact {i}: the code of room {i} is {1000 + 37 * i}." for i in range(30))


async def ask(engine, request_id, messages, session="s"):
    deltas = [d async for d in engine.generate(request_id, messages, ANSWER, session_id=session)]
    return "".join(d.text for d in deltas), deltas[-1]


async def read(engine, session, text):
    async for progress in engine.ingest(f"ingest-{session}", session, text):
        if progress.done:
            return


def frame_tensors(engine, session):
    memory = engine._frame_backend.conversations[session].memory
    out = []
    for store in memory._frame.layers:
        out += [store.sink_k, store.sink_v, store.local_k, store.local_v]
        out += [store.mem_k.view(), store.mem_v.view()]
    return out


async def conversation(engine, session, questions):
    """Ask each question resending the conversation; the turns the last deltas carried."""
    messages, turns = [], []
    for i, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        answer, last = await ask(engine, f"{session}-{i}", messages, session)
        messages.append({"role": "assistant", "content": answer})
        turns += last.turns
    return messages, turns


@pytest.mark.parametrize("strategy", list(SPECS))
async def test_imported_turns_rebuild_the_memory_bit_for_bit(make_engine, strategy):
    a, b = make_engine(), make_engine()
    spec = SPECS[strategy]
    for engine in (a, b):
        await engine.create_session("s", spec)
        await read(engine, "s", DOCUMENT)
    questions = ["What is the code of room 3?", "And room 12?", "Which room is " + "big " * 20]
    messages, turns = await conversation(a, "s", questions)
    assert [t.seq for t in turns] == [1, 2, 3]
    assert all(t.encoding is not None for t in turns)
    held = a._frame_backend.conversations["s"]
    assert turns[-1].turns == 3 and turns[-1].turn_tokens == sum(t.tokens for t in turns)
    assert held.memory.memory_tokens > 0  # the turns pushed blocks into memory

    forwards = 0

    def count(*_args):
        nonlocal forwards
        forwards += 1

    hook = b.loaded.model.register_forward_pre_hook(count)
    try:
        for turn in turns:
            await b.import_turn("s", turn)
    finally:
        hook.remove()
    assert forwards == 0
    rebuilt = b._frame_backend.conversations["s"]
    assert rebuilt.memory.state_hash == held.memory.state_hash
    assert rebuilt.turns == held.turns and rebuilt.seq == 3 and rebuilt.held == held.held
    for x, y in zip(frame_tensors(a, "s"), frame_tensors(b, "s"), strict=True):
        assert torch.equal(x, y)

    follow = [*messages, {"role": "user", "content": "And room 7?"}]
    answer_a, last_a = await ask(a, "a-next", follow)
    answer_b, last_b = await ask(b, "b-next", follow)
    assert answer_a == answer_b and last_a.turns[0].seq == last_b.turns[0].seq == 4
    assert last_b.prompt_tokens == last_a.prompt_tokens  # only the new message was read


async def test_a_turn_without_encodings_is_read_again(make_engine):
    a, b = make_engine(), make_engine()
    for engine in (a, b):
        await engine.create_session("s", SPECS["segments"])
        await read(engine, "s", DOCUMENT)
    messages, turns = await conversation(a, "s", ["Room 3?", "Room 4?"])
    for turn in turns:
        await b.import_turn("s", dataclasses.replace(turn, encoding=None))
    assert b._frame_backend.conversations["s"].memory.state_hash == turns[-1].hash_after
    follow = [*messages, {"role": "user", "content": "Room 5?"}]
    assert (await ask(a, "a-next", follow))[0] == (await ask(b, "b-next", follow))[0]


async def test_a_new_chat_restarts_after_the_documents(make_engine):
    a, b = make_engine(), make_engine()
    for engine in (a, b):
        await engine.create_session("s", SPECS["segments"])
        await read(engine, "s", DOCUMENT)
    _, first = await conversation(a, "s", ["Room 3?"])
    _, second = await conversation(a, "s", ["Something else entirely?"])  # not a continuation
    assert second[0].restart and second[0].turns == 1
    for turn in first + second:
        await b.import_turn("s", turn)
    for x, y in zip(frame_tensors(a, "s"), frame_tensors(b, "s"), strict=True):
        assert torch.equal(x, y)


async def test_a_turn_that_does_not_follow_is_refused_and_changes_nothing(make_engine):
    a, b = make_engine(), make_engine()
    for engine in (a, b):
        await engine.create_session("s", SPECS["segments"])
    await read(a, "s", DOCUMENT)  # b never read it
    _, turns = await conversation(a, "s", ["Room 3?"])
    before = b._frame_backend.conversations["s"].memory.state_hash
    with pytest.raises(InvalidRequest):
        await b.import_turn("s", turns[0])
    rebuilt = b._frame_backend.conversations["s"]
    assert rebuilt.memory.state_hash == before and rebuilt.seq == 0 and rebuilt.turns == []


async def test_a_request_past_the_memory_room_is_refused_and_changes_nothing(make_engine):
    engine = make_engine()
    await engine.create_session("s", SPECS["segments"])
    session = engine._frame_backend.conversations["s"]
    before = session.memory.num_tokens
    question = [{"role": "user", "content": "Hello?"}]
    with pytest.raises(MemoryBudgetExceeded):
        stream = engine.generate("r", question, ANSWER, session_id="s", memory_room=10)
        [d async for d in stream]
    assert session.memory.num_tokens == before and session.seq == 0
    stream = engine.generate("ok", question, ANSWER, session_id="s", memory_room=1000)
    last = [d async for d in stream][-1]
    assert last.turns[0].tokens <= 1000


async def test_a_turn_past_the_encoding_limit_goes_out_as_its_tokens(make_engine):
    a, b = make_engine(max_turn_encoding_bytes=1024), make_engine()
    for engine in (a, b):
        await engine.create_session("s", SPECS["segments"])
        await read(engine, "s", DOCUMENT)
    messages, turns = await conversation(a, "s", ["Room 3?"])
    assert turns[0].encoding is None and turns[0].tokens > 0
    await b.import_turn("s", turns[0])  # read again
    follow = [*messages, {"role": "user", "content": "Room 5?"}]
    assert (await ask(a, "a-next", follow))[0] == (await ask(b, "b-next", follow))[0]


async def test_a_turn_after_an_aborted_new_chat_imports(make_engine):
    """An aborted new chat sends the memory back to the documents and leaves no turn; the next
    turn begins there, and an import follows it back too."""
    a, b = make_engine(), make_engine()
    for engine in (a, b):
        await engine.create_session("s", SPECS["segments"])
        await read(engine, "s", DOCUMENT)
    _, first = await conversation(a, "s", ["Room 3?"])
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    stream = a.generate("new", [{"role": "user", "content": "Other?"}], long, session_id="s")
    await anext(stream)
    await a.abort("new")
    assert [d async for d in stream][-1].finish_reason == "abort"
    _, second = await conversation(a, "s", ["Room 9?"])
    assert not second[0].restart and second[0].seq == 2
    for turn in first + second:
        await b.import_turn("s", turn)
    for x, y in zip(frame_tensors(a, "s"), frame_tensors(b, "s"), strict=True):
        assert torch.equal(x, y)
