"""The frame is the model's own attention while everything fits, and behaves as one context."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.memory.chunk import chunk_mask
from engine.memory.session import SessionMemory
from engine.protocol import InvalidRequest, MemorySpec
from engine.runner.attention import use_longserve_attention

ATOL = 1e-4  # fp32 logits; un-rotating and re-rotating keys costs ~1e-6

SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny(kind: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    kw = {**SMALL, **overrides}
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=None, **kw))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    use_longserve_attention(model)  # as the loader does
    return model.eval()


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's own attention: a forward with no frame is plain SDPA."""
    with torch.inference_mode():
        return model(input_ids=ids[None]).logits[0]


# read_window 32 < local_window: while everything fits, every token is still read with the
# whole context (the read window only applies once memory is in use)
FITS = dict(sinks=16, local_window=256, chunk_size=64, block=16, k=2, u=1, read_window=32)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_matches_model_attention_while_everything_fits(kind):
    model = tiny(kind)
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(1))
    ref = reference_logits(model, ids)
    memory = SessionMemory(model, MemorySpec("segments", FITS))
    last = memory.append(ids)  # 4 chunks of 64, 56
    torch.testing.assert_close(last, ref[-1], atol=ATOL, rtol=0)
    assert memory.num_tokens == 200 and memory.memory_tokens == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_token_by_token_equals_one_append(kind):
    model = tiny(kind)
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2))
    ref = reference_logits(model, ids)
    memory = SessionMemory(model, MemorySpec("segments", FITS))
    memory.append(ids[:20])
    for i in range(20, 40):
        logits = memory.append(ids[i : i + 1])
        torch.testing.assert_close(logits, ref[i], atol=ATOL, rtol=0)


def test_token_by_token_equals_one_append_with_memory_in_use():
    model = tiny("llama")
    spec = MemorySpec("segments", dict(sinks=8, local_window=32, chunk_size=16, block=8, k=2, u=1))
    ids = torch.randint(0, 300, (160,), generator=torch.Generator().manual_seed(3))
    one = SessionMemory(model, spec)
    # chunk_size 16 for both: only the chunking of the last 16 tokens differs.
    one.append(ids[:144])
    whole = one.append(ids[144:])
    stepped = SessionMemory(model, spec)
    stepped.append(ids[:144])
    for i in range(144, 160):
        last = stepped.append(ids[i : i + 1])
    assert one.memory_tokens > 0
    # Chunking changes which tokens share a retrieval, so equality is exact only when the
    # whole memory fits the budget; here 14 blocks > k*(2u+1) = 6, so compare the argmax.
    assert whole.argmax() == last.argmax() or torch.allclose(whole, last, atol=1e-2)


@pytest.mark.parametrize("read_window", [16, 0])
def test_reading_chunks_attend_the_newest_read_window_tokens(monkeypatch, read_window):
    """Once memory is in use, a reading chunk attends the sinks, the newest read_window tokens
    of the local window and itself; the question's tail attends the whole window (and what it
    retrieves). read_window 0 is the whole window for every forward."""
    model = tiny("llama")
    knobs = dict(sinks=8, local_window=64, chunk_size=16, block=8, k=2, u=1, tail=4)
    memory = SessionMemory(model, MemorySpec("segments", {**knobs, "read_window": read_window}))
    frame = memory._frame
    attended: list[tuple[int, int, int, bool, int]] = []  # T, keys, window, in use, sinks
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        attended.append(
            (query.shape[2], key.shape[2], frame.n_local, frame.memory_used, frame.n_sinks)
        )
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = torch.randint(0, 300, (212,), generator=torch.Generator().manual_seed(6))
    memory.append(ids)  # 13 chunks of 16, then the tail of 4 (twice: a voting pass)
    reading = [a for a in attended if a[0] == 16 and a[3]]
    before = [a for a in attended if a[0] == 16 and not a[3]]
    tail = [a for a in attended if a[0] == 4]
    assert reading and before and len(tail) == 2 * 2  # two layers, vote + real pass
    for _, keys, window, _, sinks in before:  # the plain context: sinks, window, chunk
        assert keys == sinks + window + 16
    for _, keys, window, _, _ in reading:
        assert keys == 8 + (min(read_window, window) if read_window else window) + 16
    for _, keys, window, _, _ in tail:  # whole window + 6 retrieved blocks of 8
        assert keys == 8 + 48 + window + 4


# fp32: the kernels' own rounding. bfloat16 inputs carry 8 bits of mantissa (relative error
# 2^-9 each), so a softmax-weighted mean of unit-scale values is off by up to ~1e-2
BAND_ATOL = {"model": 1e-5, "bfloat16": 2e-2}


@pytest.mark.parametrize("read_dtype", ["model", "bfloat16"])
@pytest.mark.parametrize("chunk", [16, 13, 40])
def test_a_reading_chunk_attends_a_band_of_at_least_read_window_tokens(
    monkeypatch, chunk, read_dtype
):
    """Reading a chunk once memory is in use, query rows go in blocks of BAND_ROWS; a row in
    the block starting at chunk row s attends the sinks, the window's newest read_window - s
    tokens (none once s >= read_window) and the chunk up to itself. Checked against one dense
    masked fp32 attention over [sinks | newest read_window window tokens | chunk] built from
    that rule, for blocks that divide the chunk, that do not, and that run past read_window;
    in the model's dtype and in bfloat16 (FrameConfig.read_dtype), whose output is fp32."""
    from engine.memory import band as band_module

    monkeypatch.setattr(band_module, "BAND_ROWS", 6)
    model = tiny("llama")
    spec = dict(sinks=8, local_window=64, chunk_size=chunk, block=8, k=2, u=1, tail=4)
    spec.update(read_window=16, read_dtype=read_dtype)
    memory = SessionMemory(model, MemorySpec("segments", spec))
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(8))
    memory.append(ids, document=True)
    frame = memory._frame
    assert frame.memory_used and frame.n_local > 16
    g = torch.Generator().manual_seed(9)
    kvh, d, H = 2, 16, 4
    frame.begin(chunk)
    query = torch.randn(1, H, chunk, d, generator=g)
    key = torch.randn(1, kvh, chunk, d, generator=g)
    value = torch.randn(1, kvh, chunk, d, generator=g)
    out = frame.attend(0, query, key, value, scaling=d**-0.5)
    frame.abort()

    store = frame.layers[0]
    rw, S = 16, frame.n_sinks
    window = frame.rotary.rotate(store.local_k[:, -rw:], frame._local_positions()[-rw:])
    keys = torch.cat((frame.rotated_sinks(0), window, key[0]), dim=1)[None]
    values = torch.cat((store.sink_v, store.local_v[:, -rw:], value[0]), dim=1)[None]
    visible = torch.zeros(chunk, S + rw + chunk, dtype=torch.bool)
    for r in range(chunk):
        s = r - r % 6
        visible[r, :S] = True
        visible[r, S + min(s, rw) : S + rw] = True
        visible[r, S + rw : S + rw + r + 1] = True
    dense = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=visible, scale=d**-0.5, enable_gqa=True
    ).transpose(1, 2)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, dense, atol=BAND_ATOL[read_dtype], rtol=0)
    if read_dtype == "bfloat16":  # rounded, not something else that is merely close
        assert (out - dense).abs().max() > 1e-5


def test_read_dtype_auto_is_bfloat16_only_for_fp32_on_native_hardware(monkeypatch):
    from engine.memory import band as band_module

    cpu = torch.device("cpu")
    assert band_module.read_dtype("model", torch.float32, cpu) == torch.float32
    assert band_module.read_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert band_module.read_dtype("auto", torch.float16, cpu) == torch.float16
    for native in (True, False):
        monkeypatch.setattr(band_module, "_native_bfloat16", lambda kind, n=native: n)
        expected = torch.bfloat16 if native else torch.float32
        assert band_module.read_dtype("auto", torch.float32, cpu) == expected
    with pytest.raises(InvalidRequest) as e:
        SessionMemory(tiny("llama"), MemorySpec("segments", {"read_dtype": "fp8"}))
    assert e.value.param == "memory.read_dtype"


def test_a_document_is_read_without_a_tail_forward():
    """A question's last `tail` tokens get a forward of their own; a document's end asks
    nothing, so document=True reads chunk_size pieces only."""
    model = tiny("llama")
    sizes: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(7))
        spec = MemorySpec("segments", dict(sinks=8, local_window=64, chunk_size=16, tail=4, k=2))
        SessionMemory(model, spec).append(ids, document=True)
        assert sizes == [16, 16, 8]
        sizes.clear()
        SessionMemory(model, spec).append(ids)
        assert sizes == [16, 16, 4, 4]
    finally:
        hook.remove()


def test_without_a_session_the_model_is_unchanged():
    model = tiny("llama")
    ids = torch.randint(0, 300, (50,), generator=torch.Generator().manual_seed(4))
    ref = reference_logits(model, ids)
    SessionMemory(model, MemorySpec("segments", FITS))
    with torch.inference_mode():
        plain = model(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(plain, ref, atol=ATOL, rtol=0)


def test_progress_and_stop_between_chunks():
    model = tiny("llama")
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(5))
    memory = SessionMemory(model, MemorySpec("segments", FITS))
    seen: list[int] = []
    memory.append(ids, on_progress=seen.append, should_stop=lambda: len(seen) >= 2)
    assert seen == [64, 128] and memory.num_tokens == 128  # tail: 168 | 32
    memory.append(ids[128:])
    assert memory.num_tokens == 200


@pytest.mark.parametrize(
    ("strategy", "params", "param"),
    [
        ("nope", {}, "memory.strategy"),
        ("segments", {"kk": 1}, "memory.kk"),
        ("segments", {"k": 0}, "memory.k"),
        ("segments", {"k": "8"}, "memory.k"),
        ("segments", {"score": "best"}, "memory.score"),
        ("segments", {"local_window": 4096}, "memory.local_window"),
    ],
)
def test_bad_specs_are_invalid_requests(strategy, params, param):
    with pytest.raises(InvalidRequest) as e:
        SessionMemory(tiny("llama"), MemorySpec(strategy, params))
    assert e.value.param == param


def _dense_step(
    frame, layer, query, key, value, prefix_k, prefix_v, retrieved_ok, _, scaling, blocks_at,
    retrieved_rows=None, queries=None, retrieved_params=None,
):  # fmt: skip
    """The frame a decode step attended before StepCache.attend: every key rotated at its
    frame position (never block-local: RowReader.check_rows says so), one concatenated frame, one SDPA
    call."""
    assert blocks_at is None and retrieved_rows is None and retrieved_params is None
    store = frame.layers[layer]
    window = frame.rotary.rotate(store.local_k, frame._local_positions())
    keys = torch.cat((*prefix_k, window, key[0]), dim=1)[None]
    values = torch.cat((*prefix_v, store.local_v, value[0]), dim=1)[None]
    group = query.shape[1] // key.shape[1]
    mask = chunk_mask(frame, keys.shape[2] - 1, retrieved_ok, 1, group, query.dtype)
    return torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=group > 1
    ).transpose(1, 2)


class _NoReuse(dict):
    """A decode step's retrieval cache that never keeps anything."""

    def __setitem__(self, key, value) -> None:
        pass


STEP_KNOBS = {
    "segments": dict(k=2, u=1),
    "segments-fifo": dict(k=2, u=1, m=48),  # memory = k(2u+1) blocks: the same rows, shifted
    "tokens": dict(k=12),
    "neurocache": dict(k=4, w=2, c=2, r=0, fit_tokens=32),
    # memory blocks in the model's float32 (the others: float16, widened by the kernel as it
    # reads them in place, or cast as they are taken)
    "segments-fp32": dict(k=2, u=1, memory_dtype="model"),
    "tokens-fp32": dict(k=12, memory_dtype="model"),
    # memory blocks in int8 codes, widened as they are taken (never read in place)
    "segments-int8": dict(k=2, u=1, memory_dtype="int8"),
    "tokens-int8": dict(k=12, memory_dtype="int8"),
    "neurocache-int8": dict(k=4, w=2, c=2, r=0, fit_tokens=32, memory_dtype="int8"),
    # sinks and window in float16 (the engine's kv_dtype under int4 weights)
    "segments-f16window": dict(k=2, u=1),
    "tokens-f16window": dict(k=12),
    "neurocache-f16window": dict(k=4, w=2, c=2, r=0, fit_tokens=32),
}


@pytest.mark.parametrize("case", list(STEP_KNOBS))
def test_a_decode_step_attends_what_the_whole_frame_would(monkeypatch, case):
    """A decode step keeps its window's keys rotated at document positions and rotates the
    query twice instead of rebuilding the frame, and reuses the last step's retrieved rows when
    it retrieves the same; its logits are those of the frame rebuilt and retrieved afresh every
    step, over steps that move window blocks to memory, drop the oldest (FIFO m) and pass a
    rebase of the window's positions (a 128-position table: its base moves every ~100 steps)."""
    model = tiny("llama", max_position_embeddings=128)
    spec = dict(sinks=8, local_window=32, chunk_size=16, block=8, tail=4, **STEP_KNOBS[case])
    kv_dtype = "float16" if case.endswith("f16window") else "model"
    memory = SessionMemory(model, MemorySpec(case.split("-")[0], spec), kv_dtype)
    ids = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(11))
    logits = memory.append(ids)
    dense = memory.fork()
    monkeypatch.setattr(dense._frame.step_cache, "attend", _dense_step)
    monkeypatch.setattr(dense._frame.step_cache, "retrieved", _NoReuse())
    check = dense._frame.reader.check_rows  # never by whole block: every key at its frame slot
    monkeypatch.setattr(dense._frame.reader, "check_rows", lambda *a: (False, check(*a)[1]))
    taken = [0]
    take = memory._frame.reader.take_blocks  # every retrieval's gather, block-local or rotated

    def counting_take(store, idx):
        taken[0] += 1
        return take(store, idx)

    monkeypatch.setattr(memory._frame.reader, "take_blocks", counting_take)
    token, rebuilt = int(logits.argmax()), 0
    for _ in range(130):
        before = memory._frame.step_cache.window
        got = memory.append(torch.tensor([token]))
        rebuilt += before is not None and memory._frame.step_cache.window is not before
        want = dense.append(torch.tensor([token]))
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        token = int(want.argmax())
    assert memory._frame.step_cache.window is not None
    assert rebuilt >= 1  # the window's base moved at least once
    if case.startswith("segments"):  # most steps retrieve what the previous one did
        assert taken[0] < 130 * 2, f"{taken[0]} takes in 130 steps of 2 layers"
        # whole blocks: the steps attended block-local keys with a query rotated per block
        assert all(kept[3] != "rows" for kept in memory._frame.step_cache.retrieved.values())
    if case == "segments-fifo":
        assert memory._frame.n_memory <= 48 < memory._frame.num_tokens - 8 - 32


def test_growing_buffer_take_returns_each_heads_rows():
    """take(idx) is gather along the rows, through appends that grow and compact the buffer,
    front drops and a move."""
    from engine.memory.buffers import GrowingBuffer

    g = torch.Generator().manual_seed(12)
    buffer = GrowingBuffer(3, 4, torch.float32, torch.device("cpu"))
    for n, drop in ((100, 0), (300, 50), (40, 200), (500, 0)):
        buffer.append(torch.randn(3, n, 4, generator=g))
        buffer.drop_front(drop)
        idx = torch.randint(0, buffer.size, (3, 37), generator=g)
        want = buffer.view().gather(1, idx[..., None].expand(-1, -1, 4))
        torch.testing.assert_close(buffer.take(idx), want, atol=0, rtol=0)
    buffer.to(torch.device("cpu"))
    idx = torch.randint(0, buffer.size, (3, 37), generator=g)
    want = buffer.view().gather(1, idx[..., None].expand(-1, -1, 4))
    torch.testing.assert_close(buffer.take(idx), want, atol=0, rtol=0)


@pytest.mark.parametrize("strategy", ["segments", "tokens", "neurocache"])
def test_a_float16_window_steps_alike_with_and_without_the_cpu_kernels(monkeypatch, strategy):
    """Sinks and window in float16 (kv_dtype "float16"): the torch path of a decode step (no
    compiler, or a GPU) widens them as the kernels do, so both give the same logits."""
    import engine.memory.retrieval as retrieval_module
    import engine.runner.cpu_attention as cpu_attention

    if cpu_attention.load_kernel() is None:
        pytest.skip("no C++ compiler or ninja to build the kernels")
    model = tiny("llama")
    spec = dict(sinks=8, local_window=32, chunk_size=16, block=8, tail=4, **STEP_KNOBS[strategy])
    ids = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(12))
    runs = []
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(cpu_attention, "load_kernel", lambda: None)
            monkeypatch.setattr(cpu_attention, "load_extension", lambda stem: None)
            monkeypatch.setattr(retrieval_module, "load_extension", lambda stem: None)
        memory = SessionMemory(model, MemorySpec(strategy, spec), "float16")
        logits = [memory.append(ids)]
        for _ in range(12):
            logits.append(memory.append(logits[-1].argmax()[None]))
        runs.append(torch.stack(logits))
    torch.testing.assert_close(runs[0], runs[1], atol=ATOL, rtol=0)
