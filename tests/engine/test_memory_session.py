"""SessionMemory's contract: every strategy, FIFO capacity, sizes, timings, knob errors."""

from __future__ import annotations

import pytest
import torch

from engine.memory.projections import Projections
from engine.memory.session import SessionMemory
from engine.memory.strategies import STRATEGIES
from engine.protocol import InvalidRequest, MemorySpec

from .test_memory_frame import ATOL, FITS, reference_logits, tiny

FRAME = dict(sinks=8, local_window=32, chunk_size=16, block=8)
SMALL = {
    "segments": dict(FRAME, k=2, u=1),
    "tokens": dict(FRAME, k=16, index="torch"),
    "neurocache": dict(FRAME, k=4, w=2, c=2, r=0, fit_tokens=32, d=8),
}


def test_strategies_are_the_three():
    assert STRATEGIES == ("segments", "tokens", "neurocache")


@pytest.mark.parametrize("strategy", ["tokens", "neurocache"])
def test_every_strategy_is_exact_while_everything_fits(strategy):
    model = tiny("llama")
    ids = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(6))
    ref = reference_logits(model, ids)
    params = {k: v for k, v in FITS.items() if k not in ("k", "u")}
    params["k"] = 16
    memory = SessionMemory(model, MemorySpec(strategy, params))
    torch.testing.assert_close(memory.append(ids), ref[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_long_inputs_run_with_memory_in_use(kind, strategy):
    model = tiny(kind)
    memory = SessionMemory(model, MemorySpec(strategy, SMALL[strategy]))
    ids = torch.randint(0, 300, (600,), generator=torch.Generator().manual_seed(7))
    logits = memory.append(ids)  # 600 tokens > the tiny model's 512 positions
    for _ in range(3):
        logits = memory.append(logits.argmax()[None])
    assert logits.shape == (300,) and torch.isfinite(logits).all()
    assert memory.num_tokens == 603 and memory.memory_tokens > 500
    assert memory.nbytes() > 0
    assert memory.pop_retrieval_seconds() > 0 and memory.pop_retrieval_seconds() == 0.0
    assert memory._frame.last_selected  # some layer attended to memory


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fifo_capacity_keeps_memory_bounded(strategy):
    model = tiny("llama")
    memory = SessionMemory(model, MemorySpec(strategy, dict(SMALL[strategy], m=64)))
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(8))
    memory.append(ids)
    memory.append(ids[:1])
    assert memory.memory_tokens <= 64 and memory.num_tokens == 401
    for selected in memory._frame.last_selected.values():
        assert int(selected.max()) < memory.memory_tokens


def test_neurocache_loads_a_projection_by_id(tmp_path):
    model = tiny("llama")
    projections = Projections(str(tmp_path), max_bytes=2**20)
    torch.save({"weight": torch.randn(8, 64), "mean": torch.zeros(64)}, tmp_path / "wp.pt")
    params = dict(SMALL["neurocache"], projection="wp")
    memory = SessionMemory(model, MemorySpec("neurocache", params), projections=projections)
    memory.append(torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(9)))
    assert memory._selector.cache.dim == 8
    torch.save({"weight": torch.randn(4, 64), "mean": torch.zeros(64)}, tmp_path / "wp.pt")
    with pytest.raises(InvalidRequest) as e:  # the file changed: read again, and refused
        SessionMemory(model, MemorySpec("neurocache", params), projections=projections)
    assert e.value.param == "memory.projection" and str(tmp_path) not in str(e.value)
    with pytest.raises(InvalidRequest) as e:  # no directory: no id is known
        SessionMemory(model, MemorySpec("neurocache", params))
    assert str(e.value) == "unknown projection 'wp'"
    with pytest.raises(InvalidRequest) as e:  # the old knob is gone
        path_params = dict(SMALL["neurocache"], projection_path=str(tmp_path / "wp.pt"))
        SessionMemory(model, MemorySpec("neurocache", path_params), projections=projections)
    assert e.value.param == "memory.projection_path"


@pytest.mark.parametrize(
    ("strategy", "params", "param"),
    [
        ("tokens", {"layers": "0,9"}, "memory.layers"),
        ("tokens", {"index": "annoy"}, "memory.index"),
        ("neurocache", {"r": 1}, "memory.r"),  # no layer above the last
        ("neurocache", {"d": 1000}, "memory.d"),
        ("segments", {"m": 3}, "memory.m"),
    ],
)
def test_bad_knobs(strategy, params, param):
    with pytest.raises(InvalidRequest) as e:
        SessionMemory(tiny("llama"), MemorySpec(strategy, {**FRAME, **params}))
    assert e.value.param == param


def test_upper_layers_only():
    model = tiny("llama")
    memory = SessionMemory(model, MemorySpec("tokens", dict(SMALL["tokens"], layers="upper")))
    memory.append(torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(10)))
    assert set(memory._frame.last_selected) == {1}


def _run(memory: SessionMemory, ids: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    out = [memory.append(ids)]
    for _ in range(steps):
        out.append(memory.append(out[-1].argmax()[None]))
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_host_tier_and_offload_change_no_logits(strategy):
    """tier "host" keeps memory blocks on the host and copies retrieved rows over; offloading
    an idle session moves everything and the next append brings it back. Same logits."""
    model = tiny("llama")
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(9))
    reference = _run(SessionMemory(model, MemorySpec(strategy, SMALL[strategy])), ids)
    host = SessionMemory(model, MemorySpec(strategy, dict(SMALL[strategy], tier="host")))
    assert all(layer.mem_k.device.type == "cpu" for layer in host._frame.layers)
    for got, want in zip(_run(host, ids), reference, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)

    memory = SessionMemory(model, MemorySpec(strategy, SMALL[strategy]))
    first = memory.append(ids)
    memory.offload()
    assert memory.offloaded and memory._frame.device.type == "cpu"
    second = memory.append(first.argmax()[None])  # reloads first
    assert not memory.offloaded
    torch.testing.assert_close(first, reference[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(second, reference[1], atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_offload_moves_the_session_off_the_gpu(strategy):
    model = tiny("llama").to("cuda")
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(9)).cuda()
    memory = SessionMemory(model, MemorySpec(strategy, SMALL[strategy]))
    first = memory.append(ids)
    before = torch.cuda.memory_allocated()
    memory.offload()
    assert torch.cuda.memory_allocated() < before
    assert all(layer.mem_k.device.type == "cpu" for layer in memory._frame.layers)
    assert torch.isfinite(memory.append(first.argmax()[None])).all()
    assert all(layer.mem_k.device.type == "cuda" for layer in memory._frame.layers)


@pytest.mark.parametrize("strategy", ["segments", "tokens", "neurocache"])
def test_a_dropped_session_and_its_forks_are_freed_without_the_garbage_collector(strategy):
    """A session's frame (all its keys and values) is freed as soon as the session is dropped:
    no hook on the model keeps its selector alive, and the frame <-> selector reference does
    not wait for a gc pass. Checked with the collector off."""
    import gc
    import weakref

    model = tiny("llama")
    spec = MemorySpec(strategy, dict(sinks=8, local_window=32, chunk_size=16, block=8, tail=4))
    ids = torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(11))
    gc.collect()
    gc.disable()
    try:
        memory = SessionMemory(model, spec)
        memory.append(ids)
        fork = memory.fork()
        fork.append(ids[:20])
        frames = [weakref.ref(memory._frame), weakref.ref(fork._frame)]
        selectors = [weakref.ref(memory._selector), weakref.ref(fork._selector)]
        del memory, fork
        assert [r() for r in frames + selectors] == [None] * 4
    finally:
        gc.enable()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float16_memory_holds_half_the_bytes_and_rounds_only_memory(strategy):
    """memory_dtype "auto" (the default before int8) keeps a float32 model's memory blocks in
    float16 (sinks and window stay fp32): half the bytes of "model", logits within float16's
    rounding of the fp32 memory's, and a fork (the prefix cache's) keeps them half."""
    model = tiny("llama")
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(9))
    full = SessionMemory(model, MemorySpec(strategy, dict(SMALL[strategy], memory_dtype="model")))
    half = SessionMemory(model, MemorySpec(strategy, dict(SMALL[strategy], memory_dtype="auto")))
    want, got = _run(full, ids), _run(half, ids)
    for layer in half._frame.layers:
        assert layer.mem_k.data.dtype == layer.mem_v.data.dtype == torch.float16
        assert layer.window_k.data.dtype == torch.float32
    assert half._frame.n_memory == full._frame.n_memory > 0
    mem = sum(layer.mem_k.nbytes() + layer.mem_v.nbytes() for layer in half._frame.layers)
    assert mem * 2 == sum(
        layer.mem_k.nbytes() + layer.mem_v.nbytes() for layer in full._frame.layers
    )
    for g, w in zip(got, want, strict=True):  # float16 keeps ~3 decimal digits
        torch.testing.assert_close(g, w, atol=2e-3 * float(w.abs().max()), rtol=0)
    fork = half.fork()
    assert all(layer.mem_k.data.dtype == torch.float16 for layer in fork._frame.layers)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_float16_window_holds_half_its_bytes_and_rounds_only_within_float16(strategy):
    """kv_dtype "float16" (the engine's under int4 weights) keeps sinks and window in float16,
    as plain KV caches: half their bytes, logits within float16's rounding of the fp32
    window's (tokens: most of the same rows retrieved; its per-token top-k on a random model
    has near ties that rounding swaps), memory blocks as memory_dtype says; a fork keeps it."""
    model = tiny("llama")
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(9))
    spec = MemorySpec(strategy, dict(SMALL[strategy], memory_dtype="auto"))
    full, half = SessionMemory(model, spec), SessionMemory(model, spec, "float16")
    want, got = _run(full, ids), _run(half, ids)
    assert half.window_dtype == torch.float16 and full.window_dtype == torch.float32
    for layer in half._frame.layers:
        assert layer.sink_k.dtype == layer.sink_v.dtype == torch.float16
        assert layer.window_k.data.dtype == layer.window_v.data.dtype == torch.float16
        assert layer.mem_k.data.dtype == torch.float16  # memory_dtype "auto"

    def window_bytes(memory):
        return sum(
            layer.window_k.nbytes() + layer.window_v.nbytes() + layer.sink_k.nbytes
            for layer in memory._frame.layers
        )

    assert half._frame.n_memory == full._frame.n_memory > 0
    assert window_bytes(half) * 2 == window_bytes(full)
    if strategy == "tokens":  # token-level top-k: rounding may swap near-tied tokens
        for layer, rows in full._frame.last_selected.items():
            chosen = half._frame.last_selected[layer].tolist()
            for a, b in zip(rows.tolist(), chosen, strict=True):
                assert len(set(a) & set(b)) >= 0.75 * len(a)
    else:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=3e-3 * float(w.abs().max()), rtol=0)
    fork = half.fork()
    assert all(layer.window_k.data.dtype == torch.float16 for layer in fork._frame.layers)


def test_a_bfloat16_model_keeps_its_memory_in_bfloat16_under_auto():
    model = tiny("llama").to(torch.bfloat16)
    memory = SessionMemory(
        model, MemorySpec("segments", dict(SMALL["segments"], memory_dtype="auto"))
    )
    assert all(layer.mem_k.data.dtype == torch.bfloat16 for layer in memory._frame.layers)


def test_stored_encodings_are_kept_apart_by_window_precision():
    """A chunk's keys depend on the window it attended: a float16 window's encodings get a
    session fingerprint of their own; the model's dtype keeps the one it had."""
    from engine.caches.store import session_fingerprint

    model = tiny("llama")
    spec = MemorySpec("segments", SMALL["segments"])
    full, half = SessionMemory(model, spec), SessionMemory(model, spec, "float16")
    assert session_fingerprint("m", full) == session_fingerprint("m", SessionMemory(model, spec))
    assert session_fingerprint("m", full) != session_fingerprint("m", half)
