"""Memory blocks in 8 bits (memory_dtype "int8", engine/memory/quantized.py): codes that come
back within half a step of their group, sessions of every strategy whose logits stay close to
float16's at about half the bytes, and everything that copies a session (fork, offload, the
memory store's chunks, turns, batched decode rows) carrying the codes and their scales. On
tiny random models (docs/decisions/070-int8-memory-blocks.md)."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine.memory.quantized import QuantizedBuffer, quantize
from engine.memory.session import SessionMemory
from engine.memory.strategies import STRATEGIES
from engine.protocol import InvalidRequest, MemorySpec
from engine.runner.cpu_attention import load_kernel
from memory_store.encodings import decode_chunk, encode_chunk
from server.app import build_app
from server.settings import ServerSettings

from .helpers import complete_on_session
from .test_memory_frame import tiny
from .test_memory_session import SMALL, _run

CPU = torch.device("cpu")


def int8(strategy: str, **knobs) -> MemorySpec:
    return MemorySpec(strategy, {**SMALL[strategy], "memory_dtype": "int8", **knobs})


def keys_with_an_outlier_channel(heads: int = 2, n: int = 128, dim: int = 32) -> torch.Tensor:
    x = torch.randn(heads, n, dim, generator=torch.Generator().manual_seed(0))
    x[..., 3] = 40.0 + 5 * x[..., 3]  # a large, consistent channel, as keys have
    return x


def test_keys_come_back_within_half_a_step_of_their_channel_in_their_block():
    x = keys_with_an_outlier_channel()
    keys = QuantizedBuffer(2, 32, 64, CPU)
    keys.append(x)
    blocks = x.view(2, 2, 64, 32)
    span = blocks.amax(dim=2) - blocks.amin(dim=2)  # (heads, blocks, channels)
    scale = keys.params.view()[..., :32].float()
    assert (scale >= span / 255).all() and (scale <= span / 255 * (1 + 2**-9)).all()
    error = (keys.view() - x).abs().view(2, 2, 64, 32)
    assert (error <= scale[:, :, None] / 2 * (1 + 1e-5)).all()
    # the large channel has its own scale: the others keep theirs, where one scale per token
    # (values' grouping) would spread the large channel's range over every channel
    by_token = QuantizedBuffer(2, 32, 0, CPU)
    by_token.append(x)
    ordinary = [c for c in range(32) if c != 3]
    token_error = (by_token.view() - x).abs()[..., ordinary].max()
    assert float(error.view(2, 128, 32)[..., ordinary].max()) < float(token_error) / 4
    assert keys.nbytes() == x.numel() + 2 * 2 * 32 * 2 * 2  # codes + (scale, zero) per block


def test_values_come_back_within_half_a_step_of_their_token():
    x = torch.randn(2, 50, 32, generator=torch.Generator().manual_seed(1)) * 3
    values = QuantizedBuffer(2, 32, 0, CPU)
    values.append(x)
    span = x.amax(dim=-1) - x.amin(dim=-1)  # (heads, tokens)
    error = (values.view() - x).abs().amax(dim=-1)
    assert (error <= span / 255 / 2 * (1 + 2**-9)).all()
    assert values.nbytes() == x.numel() + 2 * 50 * 2 * 2


def test_a_constant_group_is_held_exactly():
    codes, scale, zero = quantize(torch.full((1, 4, 8), 0.375), dim=-1)
    assert (codes == 0).all() and (scale == 0).all() and (zero == 0.375).all()


def test_rows_read_as_whole_blocks_or_one_by_one_agree_and_drops_keep_blocks_aligned():
    x = keys_with_an_outlier_channel(n=256)
    keys = QuantizedBuffer(2, 32, 64, CPU)
    keys.append(x)
    keys.drop_front(64)
    whole = torch.arange(64, 192).expand(2, -1)  # blocks 1 and 2 of what is held now
    scattered = torch.tensor([[5, 70, 191], [0, 64, 130]])
    held = keys.view()
    for idx in (whole, scattered):
        got = keys.take_to(idx, CPU, torch.float32)
        torch.testing.assert_close(got, torch.stack([held[h, idx[h]] for h in range(2)]))
    assert float((held - x[:, 64:]).abs().max()) < 0.2
    with pytest.raises(ValueError, match="whole groups"):
        keys.drop_front(10)
    with pytest.raises(ValueError, match="whole groups"):
        keys.append(x[:, :10])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kv_dtype", ["model", "float16"])
def test_an_int8_session_answers_close_to_float16(strategy, kv_dtype):
    """Every held element is off by at most 1/510 of its group's range; sinks, window and the
    tokens being read are not quantized, so logits move less than that. Measured on the tiny
    Llama (400 tokens, 368 in memory, prompt then 3 decode steps): the largest difference from
    float16 blocks was 7.2e-4 of the largest |logit| (segments 7.1e-4, tokens 7.2e-4,
    neurocache 6.6e-4); the bound 2e-3 leaves that ~3x. A decode step's whole blocks are read
    in place as codes and scales by the CPU kernel where it is built (segments); other rows
    are widened to the window's dtype (float32, or float16 under kv_dtype float16)."""
    model = tiny("llama")
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(9))
    half = SessionMemory(model, MemorySpec(strategy, SMALL[strategy]), kv_dtype)
    quarter = SessionMemory(model, int8(strategy), kv_dtype)
    want, got = _run(half, ids), _run(quarter, ids)
    assert quarter._frame.n_memory == half._frame.n_memory > 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-3 * float(w.abs().max()), rtol=0)
    for layer in quarter._frame.layers:
        assert layer.mem_k.quantized and layer.mem_k.codes.data.dtype == torch.uint8
    retrieved = quarter._frame.step_cache.retrieved.values()
    window = quarter.window_dtype
    assert retrieved
    for kept in retrieved:
        if kept.layout == "in_place":
            assert kept.keys.dtype == kept.values.dtype == torch.uint8 and kept.params is not None
        else:
            assert kept.keys.dtype == kept.values.dtype == window
    in_place = [kept.layout == "in_place" for kept in retrieved]
    assert all(in_place) == (strategy == "segments" and load_kernel() is not None)


def test_int8_holds_about_half_of_float16_bytes_per_token():
    """SessionMemory.nbytes (what `bench passkey` reports per token) at SmolLM2's head_dim 64
    and block 64, float16 sinks and window as under the default int4 weights: int8 memory
    blocks take (1 + 4/64) / 2 = 0.53 of float16's bytes (codes, plus a float16 scale and zero
    per 64 elements); the session, with its window, sinks and summaries, 0.547 here (569
    against 1,040 bytes per token, 1,216 of 1,240 tokens in memory; decision 070 has SmolLM2's)."""
    model = tiny("llama", head_dim=64)
    knobs = dict(sinks=8, local_window=64, chunk_size=32, block=64, k=1, u=1)
    ids = torch.randint(0, 300, (1240,), generator=torch.Generator().manual_seed(2))
    sizes = {}
    for dtype in ("float16", "int8"):
        memory = SessionMemory(model, MemorySpec("segments", {**knobs, "memory_dtype": dtype}),
                               "float16")  # fmt: skip
        memory.append(ids)
        blocks = sum(s.mem_k.nbytes() + s.mem_v.nbytes() for s in memory._frame.layers)
        sizes[dtype] = (blocks, memory.nbytes() / memory.num_tokens, memory.memory_tokens)
    assert sizes["int8"][2] == sizes["float16"][2] == 1216
    assert sizes["int8"][0] * 2 == sizes["float16"][0] * (1 + 4 / 64)
    assert 0.5 < sizes["int8"][1] / sizes["float16"][1] < 0.6


def test_a_bfloat16_model_reads_its_int8_blocks_in_bfloat16():
    model = tiny("llama").to(torch.bfloat16)
    memory = SessionMemory(model, int8("segments"))
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(9))
    assert all(torch.isfinite(logits).all() for logits in _run(memory, ids))
    assert memory._selector.summaries[0]["max"].data.dtype == torch.bfloat16  # as under "auto"
    retrieved = memory._frame.step_cache.retrieved.values()
    assert retrieved and all(kept.keys.dtype == torch.bfloat16 for kept in retrieved)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_forks_offloads_and_the_host_tier_carry_codes_and_scales(strategy):
    model = tiny("llama")
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(9))
    reference = SessionMemory(model, int8(strategy))
    want = _run(reference, ids)
    host = SessionMemory(model, int8(strategy, tier="host"))
    for got, w in zip(_run(host, ids), want, strict=True):
        torch.testing.assert_close(got, w, atol=1e-4, rtol=0)

    memory = SessionMemory(model, int8(strategy))
    memory.append(ids)
    fork = memory.fork()
    fork.append(ids[:40])  # moves blocks to the fork's memory only
    assert fork.memory_tokens > memory.memory_tokens
    memory.offload()
    got = [memory.append(want[0].argmax()[None])]
    got.append(memory.append(got[-1].argmax()[None]))
    for g, w in zip(got, want[1:3], strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
    for a, b in zip(memory._frame.layers, reference._frame.layers, strict=True):
        assert torch.equal(a.mem_k.codes.view(), b.mem_k.codes.view())
        assert torch.equal(a.mem_v.params.view(), b.mem_v.params.view())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_session_rebuilt_from_stored_chunks_holds_the_same_int8_blocks(strategy):
    """The memory store keeps a chunk's float16 keys and values, before any quantization (the
    window quantizes blocks as they move to memory): a rebuilt session quantizes the same
    blocks the same way, bit for bit."""
    model = tiny("llama")
    spec = int8(strategy)
    ids = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(11))
    writer, reader = SessionMemory(model, spec), SessionMemory(model, spec)
    chunk = writer.config.chunk_size
    for start in range(0, ids.numel(), chunk):
        _, encoding = writer.ingest_chunk(ids[start : start + chunk])
        reader.import_chunk(decode_chunk(encode_chunk(encoding)))
    assert reader.memory_tokens == writer.memory_tokens > 0
    for a, b in zip(writer._frame.layers, reader._frame.layers, strict=True):
        for x, y in ((a.mem_k, b.mem_k), (a.mem_v, b.mem_v)):
            assert torch.equal(x.codes.view(), y.codes.view())
            assert torch.equal(x.params.view(), y.params.view())
    prompt = torch.arange(20, 32)
    torch.testing.assert_close(writer.append(prompt), reader.append(prompt), atol=0, rtol=0)


async def test_int8_turns_rebuild_the_session_and_batched_rows_decode_as_alone(
    make_engine, monkeypatch
):
    """A session's turns (save/restore on another replica) rebuild the same int8 blocks; an
    int8 row of every strategy decodes in a batch as alone."""
    from tests.engine import helpers, test_batched_memory, test_turn_import

    for name, spec in helpers.SPECS.items():
        monkeypatch.setitem(helpers.SPECS, name, MemorySpec(
            name, {**spec.params, "memory_dtype": "int8"}))  # fmt: skip
    assert test_turn_import.SPECS is test_batched_memory.SPECS is helpers.SPECS  # patched
    await test_turn_import.test_imported_turns_rebuild_the_memory_bit_for_bit(
        make_engine, "segments"
    )
    test_batched_memory.test_a_mixed_batch_decodes_as_each_request_alone(make_engine().loaded)


def test_a_bad_memory_dtype_is_an_invalid_request():
    with pytest.raises(InvalidRequest) as e:
        SessionMemory(tiny("llama"), MemorySpec("segments", {"memory_dtype": "int4"}))
    assert e.value.param == "memory.memory_dtype" and "int8" in str(e.value)


async def test_memory_dtype_over_http(make_engine):
    """A session asks for int8 through the API's `memory` object; a bad value is a 400 naming
    memory.memory_dtype, as every knob's."""
    engine = make_engine()
    app = build_app(ServerSettings(api_keys=["k"]), engine)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    memory = {"strategy": "segments", "sinks": 8, "local_window": 64, "chunk_size": 32,
              "block": 16, "k": 2, "u": 1}  # fmt: skip
    async with httpx.AsyncClient(
        transport=transport, base_url="http://test", headers={"Authorization": "Bearer k"}
    ) as http:
        bad = await http.post("/v1/sessions", json={"memory": {**memory, "memory_dtype": "i8"}})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "memory.memory_dtype"
        good = await http.post("/v1/sessions", json={"memory": {**memory, "memory_dtype": "int8"}})
        assert good.status_code == 200, good.text
        answer = await complete_on_session(http, engine.model.id, good.json()["id"])
    assert answer.status_code == 200, answer.text
    [session] = engine._frame_backend.conversations.values()
    assert session.memory.memory_tokens > 0
    assert all(store.mem_k.quantized for store in session.memory._frame.layers)


def test_int8_is_the_default_and_float16_stays_a_choice():
    """A session that names no memory_dtype holds int8 blocks (decision 070's figures chose
    it); "float16" and "auto" per session still hold float16 blocks for a float32 model."""
    model = tiny("llama")
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(9))
    for dtype, quantized in ((None, True), ("float16", False), ("auto", False)):
        knobs = {} if dtype is None else {"memory_dtype": dtype}
        memory = SessionMemory(model, MemorySpec("segments", {**SMALL["segments"], **knobs}))
        _run(memory, ids)
        layer = memory._frame.layers[0]
        assert memory._frame.n_memory > 0 and layer.mem_k.quantized is quantized
        if not quantized:
            assert layer.mem_k.data.dtype == torch.float16
