"""Batched decode: the decode steps of concurrent KV-path requests share one forward.

Greedy tokens must be the same as decoding each request alone. Logits of a batched step match
the unbatched ones to 1e-4 (float32: rows of a batched matmul are reduced in a different order,
so bit equality is not expected).
"""

import asyncio
import time

import pytest
import torch

from engine.protocol import EngineError, SamplingParams
from engine.runner.decode_state import KVCacheState, decode_batch
from engine.runner.generate import Generation, step_batch
from engine.scheduler.jobs import Collector, Job
from engine.scheduler.worker import Worker
from tests.engine.helpers import record_batches

LOGITS_ATOL = 1e-4
TEXTS = [
    "Hi",
    "Once upon a time, in a land far away,",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "1 2 3 4 5 6 7 8 9 10 11 12",
]


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt_ids(tokenizer, text):
    return torch.tensor(tokenizer.encode(text), dtype=torch.long)  # (T,)


def new_generation(loaded, text, sampling, **kwargs):
    ids = prompt_ids(loaded.tokenizer, text)
    state = KVCacheState(loaded.model, max_tokens=len(ids) + sampling.max_tokens)
    return Generation(state, ids, sampling, loaded.tokenizer, **kwargs)


def tokens_alone(loaded, text, sampling, **kwargs):
    return [
        t
        for d in new_generation(loaded, text, sampling, **kwargs)
        if d is not None
        for t in d.token_ids
    ]


def tokens_batched(loaded, texts, samplings, **kwargs):
    """Prefill each request alone, then decode all of them together until each finishes."""
    generations = [
        new_generation(loaded, t, s, **kwargs) for t, s in zip(texts, samplings, strict=True)
    ]
    tokens = [[] for _ in texts]
    for i, generation in enumerate(generations):
        while not generation.batch_ready and not generation.done:
            delta = next(generation)
            if delta is not None:
                tokens[i] += delta.token_ids
    batch_sizes = []
    while live := [i for i, g in enumerate(generations) if g.batch_ready]:
        batch_sizes.append(len(live))
        for i, delta in zip(
            live, step_batch(loaded.model, [generations[i] for i in live]), strict=True
        ):
            assert not isinstance(delta, Exception)
            if delta is not None:
                tokens[i] += delta.token_ids
    return tokens, batch_sizes


def test_batched_greedy_tokens_match_unbatched(tiny_loaded):
    # Different prompt lengths, and different max_tokens so rows leave the batch as they finish.
    samplings = [greedy(n) for n in (12, 20, 7, 16)]
    alone = [tokens_alone(tiny_loaded, t, s) for t, s in zip(TEXTS, samplings, strict=True)]
    batched, batch_sizes = tokens_batched(tiny_loaded, TEXTS, samplings, prefill_chunk_tokens=16)
    assert batched == alone
    assert [len(t) for t in batched] == [12, 20, 7, 16]
    assert max(batch_sizes) == 4 and min(batch_sizes) == 1


def test_batched_logits_match_unbatched(tiny_loaded):
    model, tok = tiny_loaded.model, tiny_loaded.tokenizer
    single = [KVCacheState(model) for _ in TEXTS]
    batched = [KVCacheState(model) for _ in TEXTS]
    for text, a, b in zip(TEXTS, single, batched, strict=True):
        a.prefill(prompt_ids(tok, text))
        b.prefill(prompt_ids(tok, text))
    next_ids = [11, 22, 33, 44]
    for _ in range(3):
        expected = torch.stack([s.step(t) for s, t in zip(single, next_ids, strict=True)])
        got = decode_batch(model, batched, next_ids)  # (B, vocab)
        torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)
        assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
        next_ids = got.argmax(-1).tolist()
    assert [s.num_tokens for s in batched] == [s.num_tokens for s in single]


def test_failed_batched_forward_changes_no_cache(tiny_loaded, monkeypatch):
    model, tok = tiny_loaded.model, tiny_loaded.tokenizer
    states = [KVCacheState(model) for _ in TEXTS[:2]]
    for text, state in zip(TEXTS[:2], states, strict=True):
        state.prefill(prompt_ids(tok, text))
    before = [s.num_tokens for s in states]

    def explode(*args, **kwargs):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(model.lm_head, "forward", explode)
        with pytest.raises(RuntimeError):
            decode_batch(model, states, [5, 6])
    assert [s.num_tokens for s in states] == before
    # The step runs again, alone, as if nothing had happened.
    fresh = KVCacheState(model)
    fresh.prefill(prompt_ids(tok, TEXTS[0]))
    torch.testing.assert_close(states[0].step(5), fresh.step(5), atol=LOGITS_ATOL, rtol=0)


def test_seeded_sampling_in_a_batch_matches_alone(tiny_loaded):
    sampled = [
        SamplingParams(
            max_tokens=10,
            temperature=0.8,
            top_p=0.9,
            seed=s,
            frequency_penalty=0.5,
            ignore_eos=True,
        )
        for s in (1, 2, 3)
    ]
    alone = [tokens_alone(tiny_loaded, t, s) for t, s in zip(TEXTS[:3], sampled, strict=True)]
    batched, _ = tokens_batched(tiny_loaded, TEXTS[:3], sampled)
    assert batched == alone


# -- through the engine ----------------------------------------------------------------------------


async def collect(stream):
    return [delta async for delta in stream]


def token_ids(deltas):
    return [t for d in deltas for t in d.token_ids]


async def test_concurrent_requests_decode_in_batches(make_engine):
    engine = make_engine(max_running_requests=8)
    alone = []
    for i, text in enumerate(TEXTS):
        deltas = await collect(engine.generate(f"alone{i}", text, greedy(16)))
        alone.append([t for d in deltas for t in d.token_ids])
    sizes = record_batches(engine)
    results = await asyncio.gather(
        *(
            collect(engine.generate(f"together{i}", text, greedy(16)))
            for i, text in enumerate(TEXTS)
        )
    )
    assert [[t for d in r for t in d.token_ids] for r in results] == alone
    assert all(r[-1].finish_reason == "length" for r in results)
    assert max(sizes) == len(TEXTS)  # all four decoded in one forward at some point
    assert engine.stats().num_requests_running == 0


async def test_aborting_one_request_of_a_batch_leaves_the_others_intact(make_engine):
    engine = make_engine(max_running_requests=8)
    alone = [
        await collect(engine.generate(f"a{i}", t, greedy(40))) for i, t in enumerate(TEXTS[:3])
    ]
    sizes = record_batches(engine)
    streams = [engine.generate(f"b{i}", t, greedy(40)) for i, t in enumerate(TEXTS[:3])]
    firsts = [[await anext(s), await anext(s)] for s in streams]  # b2's second: a batch of 3
    await engine.abort("b1")
    rests = [await collect(s) for s in streams]
    assert rests[1][-1].finish_reason == "abort" and rests[1][-1].completion_tokens < 40
    for i in (0, 2):
        deltas = [*firsts[i], *rests[i]]
        assert deltas[-1].finish_reason == "length"
        assert token_ids(deltas) == token_ids(alone[i])
    assert max(sizes) == 3


async def test_a_request_failing_in_a_batch_fails_alone(make_engine, monkeypatch):
    engine = make_engine(max_running_requests=8)
    alone = [
        await collect(engine.generate(f"a{i}", t, greedy(12))) for i, t in enumerate(TEXTS[:3])
    ]
    accept = Generation.accept

    def failing_accept(self, logits):
        if self.sampling.seed == 666 and self.completion_tokens >= 3:
            raise ValueError("sampler broke")
        return accept(self, logits)

    monkeypatch.setattr(Generation, "accept", failing_accept)
    sizes = record_batches(engine)
    samplings = [
        greedy(12),
        SamplingParams(max_tokens=12, temperature=0.0, seed=666, ignore_eos=True),
        greedy(12),
    ]
    results = await asyncio.gather(
        *(
            collect(engine.generate(f"b{i}", t, s))
            for i, (t, s) in enumerate(zip(TEXTS[:3], samplings, strict=True))
        ),
        return_exceptions=True,
    )
    assert isinstance(results[1], EngineError) and "sampler broke" in str(results[1])
    for i in (0, 2):
        assert [t for d in results[i] for t in d.token_ids] == [
            t for d in alone[i] for t in d.token_ids
        ]
    assert max(sizes) == 3
    assert (await engine.health()).ok


async def test_a_failing_batched_forward_falls_back_to_one_by_one(make_engine, monkeypatch):
    engine = make_engine(max_running_requests=8)
    alone = [await collect(engine.generate(f"a{i}", t, greedy(10))) for i, t in enumerate(TEXTS)]
    model = engine.loaded.model
    forward = model.forward

    def no_batches(*args, input_ids=None, **kwargs):
        if input_ids is not None and input_ids.shape[0] > 1:
            raise RuntimeError("batched kernel unavailable")
        return forward(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(model, "forward", no_batches)
    results = await asyncio.gather(
        *(collect(engine.generate(f"b{i}", t, greedy(10))) for i, t in enumerate(TEXTS))
    )
    assert [[t for d in r for t in d.token_ids] for r in results] == [
        [t for d in a for t in d.token_ids] for a in alone
    ]


# -- the worker on its own -------------------------------------------------------------------------


class FakeSteps:
    """Batchable steps yielding 0..n-1; `fail_at` makes the step producing that value raise."""

    def __init__(self, n, fail_at=None):
        self.n, self.fail_at, self.i = n, fail_at, 0
        self.done = False
        self.alone = self.batched = 0

    @property
    def batch_ready(self):
        return not self.done

    def __iter__(self):
        return self

    def produce(self):
        if self.i == self.fail_at:
            raise ValueError(f"boom at {self.i}")
        value, self.i = self.i, self.i + 1
        self.done = self.i == self.n
        return value

    def __next__(self):
        if self.done:
            raise StopIteration
        self.alone += 1
        return self.produce()

    def close(self):
        self.done = True


async def drain(collector):
    got = []
    while (item := await collector.get())[0]:
        got.append(item[1])
    return got


@pytest.mark.parametrize("whole_batch_fails", [False, True])
async def test_worker_fails_only_the_failing_job_of_a_batch(whole_batch_fails):
    def run_batch(steps_list):
        if whole_batch_fails:
            raise RuntimeError("batched forward failed")
        outputs = []
        for steps in steps_list:
            steps.batched += 1
            try:
                outputs.append(steps.produce())
            except Exception as e:
                outputs.append(e)
        return outputs

    loop = asyncio.get_running_loop()
    worker = Worker(max_waiting=8, max_running=8, run_batch=run_batch)
    good, bad = FakeSteps(5), FakeSteps(5, fail_at=2)
    good_c, bad_c = Collector(loop), Collector(loop)
    worker.submit(Job("good", good, good_c))
    worker.submit(Job("bad", bad, bad_c))
    assert await drain(good_c) == [0, 1, 2, 3, 4]
    with pytest.raises(EngineError, match="boom at 2"):
        await drain(bad_c)
    if whole_batch_fails:
        assert good.alone == 5 and good.batched == 0
    else:
        assert good.alone == 0 and good.batched == 5
    assert worker.is_alive()
    worker.stop()


class Reading:
    """Steps that cannot batch (a long read), each taking `seconds`; records when they ran."""

    batch_ready = False

    def __init__(self, n, seconds, log):
        self.n, self.seconds, self.log, self.i = n, seconds, log, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i == self.n:
            raise StopIteration
        time.sleep(self.seconds)
        self.i += 1
        self.log.append("read")
        return None

    def close(self):
        self.i = self.n


@pytest.mark.parametrize(("share", "per_read"), [(0.0, (1, 1)), (0.5, (2, 12))])
async def test_decode_steps_get_their_share_beside_a_read(share, per_read):
    """A read of 40 ms steps beside a stream of 10 ms batched steps: with share 0 one decode
    step follows each reading step; with share 0.5 decode steps run for as long as the reading
    step did (about four of them)."""
    log: list[str] = []

    def run_batch(steps_list):
        time.sleep(0.01)
        log.append("decode")
        return [steps.produce() for steps in steps_list]

    loop = asyncio.get_running_loop()
    worker = Worker(max_waiting=8, max_running=8, run_batch=run_batch, decode_share=share)
    reading, stream = Collector(loop), Collector(loop)
    worker.submit(Job("read", Reading(6, 0.04, log), reading))
    worker.submit(Job("stream", FakeSteps(200), stream))
    await drain(reading)
    worker.abort("stream")
    worker.stop()
    reads = [i for i, what in enumerate(log) if what == "read"]
    between = [b - a - 1 for a, b in zip(reads, reads[1:], strict=False)]
    assert all(per_read[0] <= n <= per_read[1] for n in between), between
