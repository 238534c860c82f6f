"""Batched decode on memory (engine/runner/rows.py): plain KV rows and memory-frame rows of every
strategy share one forward, each row attending to its own context, and decode the same greedy
tokens as each request alone (logprobs within 1e-4: rows of a batched matmul are reduced in
another order, so bit equality is not expected). On the tiny random Llama."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest
import torch

from engine.memory.session import SessionMemory
from engine.protocol import MemorySpec, SamplingParams
from engine.runner.decode_state import KVCacheState, decode_batch
from engine.runner.generate import Generation, step_batch
from engine.sessions.memory_state import MemoryState
from tests.engine.helpers import FRAME, SPECS, record_batches

ROWS = ["plain", *SPECS]  # one row of every path
LOGPROB_ATOL = 1e-4


def sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)


def prompt(seed: int, tokens: int) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([rng.randrange(3, 200) for _ in range(tokens)], dtype=torch.long)


def new_generation(loaded, kind: str, seed: int, max_tokens: int) -> Generation:
    """A plain request on a short prompt, or a memory request whose prompt has moved to memory."""
    if kind == "plain":
        ids = prompt(seed, 40)
        state = KVCacheState(loaded.model, max_tokens=len(ids) + max_tokens)
    else:
        ids = prompt(seed, 300)
        state = MemoryState(SessionMemory(loaded.model, SPECS[kind]), kind)
    return Generation(state, ids, sampling(max_tokens), loaded.tokenizer, prefill_chunk_tokens=64)


def run_alone(generation: Generation) -> tuple[list[int], list[float]]:
    deltas = [d for d in generation if d is not None]
    return [t for d in deltas for t in d.token_ids], [
        lp.logprob for d in deltas for lp in d.logprobs
    ]


def run_batched(model, generations: list[Generation], max_rows: int = 0) -> tuple[list, list[int]]:
    """Prefill each alone, then decode every ready one in one step (forwards of at most
    max_rows rows when > 0) until all finish."""
    out = [([], []) for _ in generations]

    def take(i, delta):
        if isinstance(delta, StopIteration):  # the last token fed after the end
            return
        assert not isinstance(delta, Exception), delta
        if delta is not None:
            out[i][0].extend(delta.token_ids)
            out[i][1].extend(lp.logprob for lp in delta.logprobs)

    for i, generation in enumerate(generations):
        while not generation.batch_ready and not generation.done:
            take(i, next(generation))
    sizes = []
    while live := [i for i, g in enumerate(generations) if g.batch_ready]:
        sizes.append(len(live))
        deltas = step_batch(model, [generations[i] for i in live], max_rows)
        for i, delta in zip(live, deltas, strict=True):
            take(i, delta)
    return out, sizes


def generations(loaded) -> list[Generation]:
    """One request of every path, with different max_tokens so rows leave as they finish."""
    lengths = (9, 12, 7, 10)
    return [
        new_generation(loaded, kind, seed, n)
        for seed, (kind, n) in enumerate(zip(ROWS, lengths, strict=True))
    ]


def test_a_mixed_batch_decodes_as_each_request_alone(tiny_loaded):
    alone = [run_alone(g) for g in generations(tiny_loaded)]
    batch = generations(tiny_loaded)
    batched, sizes = run_batched(tiny_loaded.model, batch)
    for kind, want, got in zip(ROWS, alone, batched, strict=True):
        assert got[0] == want[0], kind
        assert got[1] == pytest.approx(want[1], abs=LOGPROB_ATOL), kind
    assert max(sizes) == len(ROWS) and min(sizes) < len(ROWS)
    # the memory rows decoded with retrieval: their prompts had moved past the frame
    assert all(g.state.memory.memory_tokens > 0 for g in batch[1:])


def test_batch_invariant_steps_decode_bit_for_bit_as_alone(tiny_loaded):
    """EngineConfig.batch_invariant: forwards of `invariant_rows` rows (1 here: the tiny fp32
    model multiplies with torch's GEMM) give every row exactly its lone logprobs."""
    from engine.runner.decode_step import decoder_of

    rows = decoder_of(tiny_loaded.model).invariant_rows
    assert rows == 1
    model = tiny_loaded.model
    # alone as the worker runs a lone request: its decode steps are batches of one
    alone = [run_batched(model, [g])[0][0] for g in generations(tiny_loaded)]
    batched, sizes = run_batched(model, generations(tiny_loaded), rows)
    assert batched == alone
    assert max(sizes) == len(ROWS)  # one step held every request; its forwards did not


def test_a_failed_mixed_forward_changes_no_row(tiny_loaded, monkeypatch):
    model = tiny_loaded.model
    made = [new_generation(tiny_loaded, kind, seed, 4) for seed, kind in enumerate(ROWS)]
    for g in made:
        while not g.batch_ready:
            next(g)
    before = [g.state.num_tokens for g in made]

    def explode(*args, **kwargs):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(model.lm_head, "forward", explode)
        with pytest.raises(RuntimeError):
            decode_batch(model, [g.state for g in made], [g.next_token for g in made])
    assert [g.state.num_tokens for g in made] == before
    # each request then runs its step alone, as if the batch had never been tried
    fresh = [new_generation(tiny_loaded, kind, seed, 4) for seed, kind in enumerate(ROWS)]
    for kind, g, f in zip(ROWS, made, fresh, strict=True):
        tokens, logprobs = run_alone(f)
        assert run_alone(g) == (tokens[1:], logprobs[1:]), kind  # the first: with the prefill


def test_the_end_of_turn_is_fed_in_batched_steps(tiny_loaded):
    """With `after`, the answer's last token and the end of turn join the memory one batched
    step each; the memory ends as when fed alone."""

    def turn(kind):
        g = new_generation(tiny_loaded, kind, 7, 5)
        g._after = [11, 12]  # what sessions pass: the template's end of turn
        return g

    alone = turn("segments")
    run_alone(alone)
    batch = [turn("segments"), new_generation(tiny_loaded, "plain", 1, 9)]
    _, sizes = run_batched(tiny_loaded.model, batch)
    memory, want = batch[0].state.memory, alone.state.memory
    assert memory.num_tokens == want.num_tokens == 300 + 5 + 2
    assert memory.state_hash == want.state_hash
    assert sizes[:7] == [2] * 7  # 4 decode steps after the first token, then 3 fed tokens
    assert batch[0].done and batch[0].unread_tail() == []


def test_a_turn_stopped_early_leaves_its_tail_unread(tiny_loaded):
    g = new_generation(tiny_loaded, "segments", 7, 5)
    g._after = [11, 12]
    while not g.finished:
        next(g)
    last = g.output_ids[-1]
    assert g.unread_tail() == [last, 11, 12]
    next(g)  # the answer's last token is read
    assert g.unread_tail() == [11, 12] and not g.done
    stopped = new_generation(tiny_loaded, "segments", 7, 5)
    stopped._after = [11, 12]
    while stopped.next_token is None:
        next(stopped)
    assert stopped.unread_tail() == [stopped.next_token, 11, 12]


# -- through the engine ----------------------------------------------------------------------------


async def collect(stream):
    return [delta async for delta in stream]


def token_ids(deltas):
    return [t for d in deltas for t in d.token_ids]


async def test_sessions_and_plain_requests_decode_in_one_batch(make_engine):
    engine = make_engine(max_running_requests=8)
    for kind, spec in SPECS.items():
        await engine.create_session(kind, spec)
        await collect(engine.ingest(f"i-{kind}", kind, " ".join(["orchard lantern copper"] * 60)))
    ask = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    question = [{"role": "user", "content": "Which word comes after lantern?"}]

    def request(tag, kind):
        if kind == "plain":
            return engine.generate(f"{tag}-plain", "Once upon a time,", ask)
        return engine.generate(f"{tag}-{kind}", question, ask, session_id=kind)

    # alone, one at a time; the same new chat again later starts again after the documents
    alone = [token_ids(await collect(request("alone", kind))) for kind in ROWS]
    sizes = record_batches(engine)
    together = await asyncio.gather(*(collect(request("together", kind)) for kind in ROWS))
    assert [token_ids(d) for d in together] == alone
    assert max(sizes) == len(ROWS)
    for kind in SPECS:  # the answer joined each session's turns as when decoded alone
        session = engine._frame_backend.conversations[kind]
        assert session.turns[-1][1] == "".join(d.text for d in together[ROWS.index(kind)])


@pytest.fixture(scope="module")
def bf16_loaded(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.runner.loader import load_model

    return load_model(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="bfloat16"))


@pytest.mark.parametrize("kind", list(SPECS))
def test_a_bfloat16_model_decodes_on_memory_on_the_cpu(bf16_loaded, kind):
    """A bfloat16 model on the CPU holds its sinks, window and memory in bfloat16, which the CPU
    kernels do not read: its memory steps take torch's ops, alone and batched, and agree."""
    alone, _ = run_alone(new_generation(bf16_loaded, kind, 5, 6))
    [(batched, _)], _ = run_batched(bf16_loaded.model, [new_generation(bf16_loaded, kind, 5, 6)])
    assert len(alone) == 6
    assert batched == alone


def test_a_bfloat16_model_with_float16_memory_decodes_on_the_cpu(bf16_loaded, monkeypatch):
    """float16 memory blocks the kernels could read do not send a bfloat16 model's steps to
    them: segments' running block scores and the window stay bfloat16."""
    spec = MemorySpec("segments", {**FRAME, "k": 2, "u": 1, "memory_dtype": "float16"})
    monkeypatch.setitem(SPECS, "segments", spec)
    alone, _ = run_alone(new_generation(bf16_loaded, "segments", 5, 6))
    [(batched, _)], _ = run_batched(
        bf16_loaded.model, [new_generation(bf16_loaded, "segments", 5, 6)]
    )
    assert len(alone) == 6
    assert batched == alone


def test_memory_rows_attended_in_one_kernel_call_decode_as_row_by_row(tiny_loaded, monkeypatch):
    """A batched step's memory rows are attended by one kernel call per layer
    (cpu_attention.PiecesBatch), not a call per row: the same tokens and logprobs, exactly."""
    from engine.runner import cpu_attention, decode_step

    if cpu_attention.load_kernel() is None:
        pytest.skip("no C++ compiler or ninja to build the kernel")
    runs = []
    real_run = cpu_attention.PiecesBatch.run

    def counted(batch):
        runs.append(len(batch.calls))
        real_run(batch)

    monkeypatch.setattr(cpu_attention.PiecesBatch, "run", counted)

    def decode() -> list:
        batch = [new_generation(tiny_loaded, kind, seed, 6) for seed, kind in enumerate(SPECS)]
        return run_batched(tiny_loaded.model, batch)[0]

    together = decode()
    assert max(runs) >= 2  # several rows' frames in one call
    monkeypatch.setattr(decode_step, "deferring", contextlib.nullcontext)
    assert decode() == together
