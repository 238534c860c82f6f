"""Preparing prompts off the event loop (engine/scheduler/preprocess.py, engine/runner/tokenize.py;
docs/decisions/057): a tenant's share of the threads, its waiting line, cancellation, and long
texts encoded in pieces to the same ids."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from engine.protocol import EngineOverloaded, InvalidRequest, SamplingParams, StructuredOutput
from engine.runner import tokenize
from engine.scheduler.preprocess import Preprocessor


def _blocking(release: threading.Event, ran: list[str], name: str):
    def job() -> str:
        ran.append(name)
        assert release.wait(10)
        return name

    return job


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def test_one_tenant_holds_its_share_and_others_still_run() -> None:
    pool = Preprocessor(threads=2, threads_per_tenant=1, max_waiting_per_tenant=4)
    release, ran = threading.Event(), []
    first = asyncio.create_task(pool.run("a", _blocking(release, ran, "a1")))
    second = asyncio.create_task(pool.run("a", _blocking(release, ran, "a2")))
    await _until(lambda: ran == ["a1"])
    # tenant b gets the other thread at once, while a's second prompt waits for a's share
    assert await asyncio.wait_for(pool.run("b", lambda: "b1"), 5) == "b1"
    assert ran == ["a1"] and pool.waiting == 1
    release.set()
    assert await asyncio.gather(first, second) == ["a1", "a2"]
    assert pool.waiting == 0 and not pool._slots  # idle tenants leave nothing behind


async def test_a_tenant_past_its_waiting_line_gets_overloaded() -> None:
    pool = Preprocessor(threads=2, threads_per_tenant=1, max_waiting_per_tenant=1)
    release, ran = threading.Event(), []
    running = asyncio.create_task(pool.run("a", _blocking(release, ran, "a1")))
    await _until(lambda: ran == ["a1"])
    waiting = asyncio.create_task(pool.run("a", _blocking(release, ran, "a2")))
    await _until(lambda: pool.waiting == 1)
    with pytest.raises(EngineOverloaded):
        await pool.run("a", lambda: "a3")
    assert await pool.run("b", lambda: "b1") == "b1"  # only that tenant is refused
    release.set()
    await asyncio.gather(running, waiting)


async def test_a_cancelled_prompt_never_runs_and_a_running_one_keeps_its_slot() -> None:
    pool = Preprocessor(threads=2, threads_per_tenant=1, max_waiting_per_tenant=4)
    release, ran = threading.Event(), []
    running = asyncio.create_task(pool.run("a", _blocking(release, ran, "a1")))
    await _until(lambda: ran == ["a1"])
    waiting = asyncio.create_task(pool.run("a", _blocking(release, ran, "a2")))
    await _until(lambda: pool.waiting == 1)
    waiting.cancel()  # a client going away while its prompt waits
    running.cancel()  # ... and while its prompt is being tokenized
    await asyncio.gather(running, waiting, return_exceptions=True)
    assert pool.waiting == 0
    # the abandoned tokenization still holds a's thread until it ends: a's next one waits
    late = asyncio.create_task(pool.run("a", lambda: "a3"))
    await asyncio.sleep(0.2)
    assert not late.done()
    release.set()
    assert await asyncio.wait_for(late, 5) == "a3"
    assert ran == ["a1"]  # the cancelled waiting prompt never ran


async def test_engine_prepares_once_off_the_loop(engine) -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prepared = await engine.prepare("Hello there", greedy, tenant="t")
    assert prepared.num_tokens == len(engine.encode_prompt("Hello there"))
    answers = [
        [d async for d in engine.generate(f"r{i}", prepared, greedy)] for i in range(2)
    ]  # both choices run from the same ids
    plain = [d async for d in engine.generate("plain", "Hello there", greedy)]
    assert [d.token_ids for d in answers[0]] == [d.token_ids for d in plain]
    assert answers[0][-1].prompt_tokens == prepared.num_tokens
    with pytest.raises(InvalidRequest):
        await engine.prepare("", greedy)
    bad = StructuredOutput("json_schema", '{"type": "object", "minProperties": "x"}')
    with pytest.raises(InvalidRequest):
        await engine.prepare("Hi", SamplingParams(response_format=bad))


@pytest.mark.parametrize("split_special_tokens", [False, True])
@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_long_texts_encode_in_pieces_to_the_same_ids(
    tokenizer, monkeypatch, split_special_tokens, add_special_tokens
) -> None:
    monkeypatch.setattr(tokenize, "PIECE_CHARS", 2000)
    rnd = random.Random(0)
    words = ["the", "  ", "quick", "brown\n\n", "fox.", "Ünïcode", "数字", "<|im_start|>"]
    words += ["123", "  x", "\t", "!!", "\n", "don't", " "]
    text = "".join(rnd.choice(words) + " " * (rnd.random() < 0.6) for _ in range(6000))
    assert len(tokenize._pieces(tokenizer.backend_tokenizer, text)) > 5
    expected = tokenizer(
        text, add_special_tokens=add_special_tokens, split_special_tokens=split_special_tokens
    ).input_ids
    got = tokenize.encode_text(
        tokenizer,
        text,
        add_special_tokens=add_special_tokens,
        split_special_tokens=split_special_tokens,
    )
    assert got == list(expected)
    ids = tokenize.encode_ids(
        tokenizer,
        text,
        add_special_tokens=add_special_tokens,
        split_special_tokens=split_special_tokens,
    )
    assert ids.tolist() == got
