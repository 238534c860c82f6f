"""Requests on one session at once: they run one at a time in arrival order, and `turns` (the
answers the session holds) is a function of what each request sent, not of which ran first: a
continuation overtaken by a new chat is read whole as a new chat and counts the same."""

from __future__ import annotations

import asyncio

import pytest

from engine.protocol import SamplingParams

ANSWER = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
DOC = "The ferry leaves at dawn and the lamp keeper rows back at dusk. " * 12


async def turns_of(engine, request_id: str, messages: list) -> tuple[str, int]:
    text, turns = "", None
    async for delta in engine.generate(request_id, messages, ANSWER, session_id="s"):
        text += delta.text
        turns = delta.turns or turns
    assert turns is not None
    return text, turns[-1].turns


@pytest.mark.parametrize("continuation_first", [True, False])
async def test_turns_do_not_depend_on_arrival_order(
    make_engine, small_memory_spec, continuation_first
):
    engine = make_engine()
    await engine.create_session("s", small_memory_spec)
    async for _ in engine.ingest("d", "s", DOC):
        pass
    first = {"role": "user", "content": "When does the ferry leave?"}
    answer, turns = await turns_of(engine, "q1", [first])
    assert turns == 1
    continuation = [first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And back?"}]  # fmt: skip
    new_chat = [{"role": "user", "content": "Who rows back?"}]
    # both submitted before either runs: the worker takes a session's requests in arrival order
    pair = [("c", continuation), ("n", new_chat)]
    if not continuation_first:
        pair.reverse()
    results = dict(
        zip(
            [name for name, _ in pair],
            await asyncio.gather(*(turns_of(engine, name, m) for name, m in pair)),
            strict=True,
        )
    )
    assert results["c"][1] == 2  # its earlier answer and its own, either way
    assert results["n"][1] == 1
    held = engine._frame_backend.conversations["s"].turns
    last = pair[-1][1]
    assert [t for t, _ in held[: len(last)]] == [m["role"] for m in last]
