"""Preparing prompts off the event loop (engine/scheduler/preprocess.py, engine/runner/tokenize.py;
docs/decisions/057): a tenant's share of the threads, its waiting line, cancellation, and long
texts encoded in pieces to the same ids."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import threading
import time

import pytest

from engine.protocol import (
    EngineOverloaded,
    InvalidRequest,
    SamplingParams,
    StructuredOutput,
    TokenPrompt,
    TooManyTokens,
)
from engine.runner import tokenize
from engine.scheduler.preprocess import Preprocessor, lower_thread_priority


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
    assert len(list(tokenize._pieces(tokenizer.backend_tokenizer, text))) > 5
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


def _counting_pieces(monkeypatch) -> list[int]:
    """Pieces encoded so far, in a list the test reads."""
    seen = [0]
    pieces = tokenize._pieces

    def counted(backend, text):
        for piece in pieces(backend, text):
            seen[0] += 1
            yield piece

    monkeypatch.setattr(tokenize, "_pieces", counted)
    return seen


def test_a_text_past_the_limit_is_refused_without_encoding_the_rest(tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(tokenize, "PIECE_CHARS", 2000)
    text = "lantern glows over the harbour. " * 20_000  # 640K characters: ~320 pieces
    total = len(tokenizer(text).input_ids)
    seen = _counting_pieces(monkeypatch)
    with pytest.raises(TooManyTokens) as refused:
        tokenize.encode_ids(tokenizer, text, limit=1500)
    assert refused.value.limit == 1500 and 1500 < refused.value.at_least < 3000 < total
    assert seen[0] <= 4  # stopped at the first piece past the limit, not after ~320
    with pytest.raises(TooManyTokens):
        tokenize.encode_text(tokenizer, text, limit=1500)
    # a limit the text fits in changes nothing
    assert tokenize.encode_ids(tokenizer, text, limit=total).tolist() == tokenizer(text).input_ids
    with pytest.raises(TooManyTokens):
        tokenize.encode_ids(tokenizer, text, limit=total - 1)
    with pytest.raises(TooManyTokens):  # a short text, encoded whole, is counted after
        tokenize.encode_ids(tokenizer, "a b c d", limit=2)


async def test_engine_stops_tokenizing_a_prompt_at_the_limit(engine, monkeypatch) -> None:
    monkeypatch.setattr(tokenize, "PIECE_CHARS", 2000)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    text = "lantern glows over the harbour. " * 20_000
    seen = _counting_pieces(monkeypatch)
    messages = [{"role": "user", "content": text}]
    with pytest.raises(TooManyTokens) as refused:
        await engine.prepare(messages, greedy, tenant="t", token_limit=1000)
    assert 1000 < refused.value.at_least < 2500 and seen[0] <= 4
    with pytest.raises(TooManyTokens):
        await engine.prepare(text, greedy, tenant="t", token_limit=1000)
    with pytest.raises(TooManyTokens):
        await engine.tokenize(messages, tenant="t", token_limit=1000)
    short = [{"role": "user", "content": "Hello there"}]
    count = (await engine.prepare(short, greedy, tenant="t")).num_tokens
    assert (await engine.prepare(short, greedy, token_limit=count)).num_tokens == count
    with pytest.raises(TooManyTokens):  # the template's own tokens count too
        await engine.prepare(short, greedy, token_limit=count - 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness")
async def test_preprocessing_threads_run_at_a_lower_priority() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    pool = Preprocessor(1, 1, 4, on_start=lambda: lower_thread_priority(5))

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    assert await pool.run("t", niceness) == min(19, base + 5)
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the loop's thread keeps its own


async def test_a_token_id_prompt_reads_its_ids_as_they_are(engine) -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = engine.encode_prompt("Hello there")
    prepared = await engine.prepare(TokenPrompt(tuple(ids)), greedy, tenant="t")
    assert prepared.token_ids.tolist() == ids and prepared.prompt == "Hello there"
    by_ids = [d async for d in engine.generate("ids", prepared, greedy)]
    by_text = [d async for d in engine.generate("text", "Hello there", greedy)]
    assert [d.token_ids for d in by_ids] == [d.token_ids for d in by_text]
    vocab = len(engine._tokenizer)
    with pytest.raises(InvalidRequest, match=rf"prompt\[1\] is {vocab}"):
        await engine.prepare(TokenPrompt((ids[0], vocab)), greedy)
    with pytest.raises(InvalidRequest, match="empty"):
        await engine.prepare(TokenPrompt(()), greedy)
    with pytest.raises(TooManyTokens):
        await engine.prepare(TokenPrompt(tuple(ids)), greedy, token_limit=len(ids) - 1)
