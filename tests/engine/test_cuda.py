"""The CUDA path: the engine's decode rows, memory frames of every strategy and the served
engine on a GPU, against the same tiny model on the CPU. Skipped without CUDA (marker `gpu`;
run with `pytest -m gpu`)."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.config import EngineConfig
from engine.memory.session import SessionMemory
from engine.memory.strategies import STRATEGIES
from engine.protocol import MemorySpec, SamplingParams
from engine.runner.loader import load_model

from .test_batched_memory import ROWS, generations, run_alone, run_batched
from .test_memory_session import SMALL

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
# fp32 on both devices; cuBLAS and the CPU reduce in other orders (tokens' frame differed
# by up to 2.3e-3 on an H200)
ATOL = 5e-3


@pytest.fixture(scope="module")
def cuda_loaded(tiny_model_dir):
    return load_model(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32"))


def test_the_model_loads_on_the_gpu(cuda_loaded):
    assert next(cuda_loaded.model.parameters()).device.type == "cuda"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_memory_session_on_the_gpu_gives_the_cpu_logits(tiny_loaded, strategy):
    """segments and neurocache within float32 rounding. tokens' exact top-k flips near ties
    between the two devices' roundings (on an H200, 4% of the logits moved by up to 0.011
    in a decode step), so it keeps the greedy token and a looser bound."""
    atol = 0.05 if strategy == "tokens" else ATOL
    cpu_model = copy.deepcopy(tiny_loaded.model).float()
    gpu_model = copy.deepcopy(cpu_model).cuda()
    ids = torch.randint(0, 300, (600,), generator=torch.Generator().manual_seed(3))
    spec = MemorySpec(strategy, SMALL[strategy])
    on_cpu, on_gpu = SessionMemory(cpu_model, spec), SessionMemory(gpu_model, spec)
    want, got = on_cpu.append(ids), on_gpu.append(ids.cuda())
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=0)
    for _ in range(4):  # decode steps: the frame's single-token path
        token = want.argmax()[None]
        assert int(got.argmax()) == int(token)
        want, got = on_cpu.append(token), on_gpu.append(token.cuda())
        torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=0)
    assert on_gpu.memory_tokens == on_cpu.memory_tokens > 0


def test_a_mixed_batch_on_the_gpu_decodes_as_each_request_alone(cuda_loaded):
    alone = [run_alone(g) for g in generations(cuda_loaded)]
    batched, sizes = run_batched(cuda_loaded.model, generations(cuda_loaded))
    for kind, want, got in zip(ROWS, alone, batched, strict=True):
        assert got[0] == want[0], kind
        assert got[1] == pytest.approx(want[1], abs=1e-3), kind
    assert max(sizes) == len(ROWS)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bfloat16_memory_decodes_on_the_gpu(tiny_model_dir, strategy):
    """The GPU's default dtype (bfloat16) with the engine's kv_dtype: finite logits through
    reading and decode steps."""
    loaded = load_model(EngineConfig(model=str(tiny_model_dir), device="cuda"))
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    memory = SessionMemory(loaded.model, MemorySpec(strategy, SMALL[strategy]), loaded.kv_dtype)
    ids = torch.randint(0, 300, (600,), generator=torch.Generator().manual_seed(4)).cuda()
    logits = memory.append(ids)
    for _ in range(4):
        logits = memory.append(logits.argmax()[None])
    assert torch.isfinite(logits).all() and memory.memory_tokens > 0


async def test_the_engine_answers_plain_and_memory_requests_on_the_gpu(
    cuda_loaded, small_memory_spec
):
    from engine.client import LocalEngine

    engine = LocalEngine(EngineConfig(device="cuda", dtype="float32"), loaded=cuda_loaded)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        plain = [d async for d in engine.generate("p", "Hello there", greedy)]
        long = [
            d async for d in engine.generate("m", "word " * 300, greedy, memory=small_memory_spec)
        ]
    finally:
        await engine.shutdown()
    assert plain[-1].completion_tokens == 6
    assert long[-1].completion_tokens == 6 and long[-1].stats.strategy == "segments"
