import pytest
import torch

from engine.memory.session import SessionMemory
from engine.protocol import SamplingParams
from engine.runner.decode_state import KVCacheState
from engine.runner.generate import Generation
from engine.sessions.memory_state import MemoryState


def run(loaded, prompt_ids, sampling, **kwargs):
    state = KVCacheState(loaded.model)
    steps = Generation(state, prompt_ids, sampling, loaded.tokenizer, **kwargs)
    deltas = [d for d in steps if d is not None]
    return deltas, [t for d in deltas for t in d.token_ids]


def prompt(loaded, text="Once upon a time, in a land far away,"):
    return torch.tensor(loaded.tokenizer.encode(text), dtype=torch.long)  # (T,)


def test_kv_cache_path_matches_model_generate(tiny_loaded):
    ids = prompt(tiny_loaded)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    _, tokens = run(tiny_loaded, ids, greedy)
    with torch.inference_mode():
        reference = tiny_loaded.model.generate(
            ids[None],
            attention_mask=torch.ones_like(ids)[None],
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
        )
    assert tokens == reference[0, len(ids) :].tolist()


def test_chunked_prefill_gives_the_same_tokens(tiny_loaded):
    ids = prompt(tiny_loaded)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    _, whole = run(tiny_loaded, ids, greedy)
    _, chunked = run(tiny_loaded, ids, greedy, prefill_chunk_tokens=3)
    assert chunked == whole


def test_max_tokens_finishes_with_length(tiny_loaded):
    deltas, tokens = run(
        tiny_loaded,
        prompt(tiny_loaded),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
    )
    assert len(tokens) == 5
    last = deltas[-1]
    assert last.finish_reason == "length" and last.completion_tokens == 5
    assert last.stats is not None and last.stats.prefill_seconds > 0
    assert all(d.finish_reason is None for d in deltas[:-1])
    text = "".join(d.text for d in deltas)
    assert text == tiny_loaded.tokenizer.decode(tokens, skip_special_tokens=True)


def test_eos_finishes_with_stop_unless_ignored(tiny_loaded):
    ids = prompt(tiny_loaded)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    _, tokens = run(tiny_loaded, ids, greedy)
    # Declare the last greedy token an end-of-turn token: generation must stop at its first use.
    end = tokens[-1]
    deltas, stopped = run(
        tiny_loaded, ids, SamplingParams(max_tokens=6, temperature=0.0), stop_token_ids=[end]
    )
    assert stopped == tokens[: tokens.index(end) + 1]
    assert deltas[-1].finish_reason == "stop"
    _, ignored = run(tiny_loaded, ids, greedy, stop_token_ids=[end])
    assert ignored == tokens


def test_seeded_sampling_is_reproducible(tiny_loaded):
    ids = prompt(tiny_loaded)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    assert run(tiny_loaded, ids, sampled)[1] == run(tiny_loaded, ids, sampled)[1]


def test_logprobs_on_every_token(tiny_loaded):
    deltas, tokens = run(
        tiny_loaded,
        prompt(tiny_loaded),
        SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3
        ),
    )
    entries = [e for d in deltas for e in d.logprobs]
    assert len(entries) == len(tokens) == 4
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy = top-1


def test_memory_state_appends_every_token(tiny_loaded, small_memory_spec):
    memory = SessionMemory(tiny_loaded.model, small_memory_spec)
    state = MemoryState(memory, "segments")
    ids = prompt(tiny_loaded)
    deltas = [
        d
        for d in Generation(
            state,
            ids,
            SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
            tiny_loaded.tokenizer,
            after=(),
        )
        if d is not None
    ]
    assert deltas[-1].finish_reason == "length"
    assert memory.num_tokens == len(ids) + 3


def test_a_finished_generation_frees_its_state_without_the_cyclic_gc(tiny_loaded):
    """The prompt's reader is closed once read: left suspended, its frame held the Generation
    and its state (a session's frame read afresh: ~80 MB) in a cycle until the cyclic GC ran,
    and a served session grew by that much a question (docs/decisions/084)."""
    import gc
    import weakref

    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    gc.collect()
    gc.disable()
    try:
        state = KVCacheState(tiny_loaded.model)
        gone = weakref.ref(state)
        steps = Generation(state, prompt(tiny_loaded), greedy, tiny_loaded.tokenizer,
                           prefill_chunk_tokens=4)  # fmt: skip
        assert len([d for d in steps if d is not None]) >= 1
        del state, steps
        assert gone() is None
    finally:
        gc.enable()
