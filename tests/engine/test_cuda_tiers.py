"""The paths built after the first GPU run (decision 047), on a GPU against the CPU: int8
memory blocks, the disk tier under a GPU session (device -> RAM -> disk and back), and answer
adapters. Skipped without CUDA (marker `gpu`; run with `pytest -m gpu`)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from engine.memory.mapped import DiskArena
from engine.memory.session import SessionMemory
from engine.memory.strategies import STRATEGIES
from engine.protocol import MemorySpec
from engine.runner.adapter import read_adapter
from engine.runner.decode_state import decode_batch
from engine.runner.decode_step import attach_decoder

from .test_adapter import prefilled, write_adapter
from .test_decode_step import tiny_llama
from .test_memory_frame import tiny
from .test_memory_session import SMALL, _run

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
ATOL = 5e-3  # as test_cuda.py: cuBLAS and the CPU reduce in other orders


def int8(strategy: str, **extra: object) -> MemorySpec:
    return MemorySpec(strategy, dict(SMALL[strategy], memory_dtype="int8", **extra))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_int8_session_on_the_gpu_gives_the_cpu_logits(strategy):
    """Codes and scales are made on the device: the GPU's int8 blocks read as the CPU's.
    tokens keeps the looser bound of test_cuda.py (its exact top-k flips near ties)."""
    atol = 0.05 if strategy == "tokens" else ATOL
    cpu_model = tiny("llama")
    gpu_model = copy.deepcopy(cpu_model).cuda()
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(9))
    want = _run(SessionMemory(cpu_model, int8(strategy)), ids)
    on_gpu = SessionMemory(gpu_model, int8(strategy))
    got = _run(on_gpu, ids.cuda())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu(), w, atol=atol, rtol=0)
    layer = on_gpu._frame.layers[0]
    assert layer.mem_k.quantized and layer.mem_k.codes.data.device.type == "cuda"


@pytest.mark.parametrize(("strategy", "memory_dtype"), [("segments", "auto"), ("segments", "int8"),
                                                        ("neurocache", "auto")])  # fmt: skip
def test_a_gpu_session_spilled_to_disk_answers_as_one_offloaded_to_ram(
    tmp_path, strategy, memory_dtype
):
    """A GPU session goes to RAM (offload), then its blocks to the disk tier (spill). Back on
    the GPU its blocks stay in the tier, as under tier "host": each step copies the rows it
    retrieves over, and reads exactly as a session that went to RAM only."""
    model = tiny("llama").cuda()
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(9)).cuda()
    spec = MemorySpec(strategy, dict(SMALL[strategy], memory_dtype=memory_dtype))
    arena = DiskArena(str(tmp_path), budget=1 << 26, max_rows=4096)
    ram, disk = SessionMemory(model, spec), SessionMemory(model, spec, arena=arena)
    first = ram.append(ids)
    assert torch.equal(disk.append(ids), first)
    assert not disk.spill()  # blocks on the GPU are not the disk tier's
    ram.offload()
    disk.offload()
    assert disk.spill() and disk.on_disk and arena.used > 0
    token = first.argmax()[None]
    want, got = ram.append(token), disk.append(token)  # both read back onto the GPU
    assert got.device.type == "cuda" and torch.equal(got, want)
    assert disk.on_disk and all(layer.mem_k.device.type == "cpu" for layer in disk._frame.layers)
    assert all(layer.mem_k.device.type == "cuda" for layer in ram._frame.layers)
    del disk
    gc.collect()
    assert arena.used == 0


def test_an_adapted_step_on_the_gpu_gives_the_cpu_logits(tmp_path):
    """An answer adapter's LoRA on q, k and v, on rows beside rows without it."""
    cpu_model = tiny_llama()
    path = write_adapter(tmp_path / "a.safetensors", cpu_model)
    gpu_model = copy.deepcopy(cpu_model).cuda()
    attach_decoder(gpu_model)  # its fused weights and rotary tables are made on the device
    on_cpu, on_gpu = read_adapter(path, cpu_model), read_adapter(path, gpu_model)
    cpu_rows = [prefilled(cpu_model, n) for n in (30, 47)]
    gpu_rows = [prefilled(gpu_model, n) for n in (30, 47)]
    with torch.inference_mode():
        for token in (9, 17, 4):
            want = decode_batch(cpu_model, cpu_rows, [token] * 2, [on_cpu, None])
            got = decode_batch(gpu_model, gpu_rows, [token] * 2, [on_gpu, None])
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g.cpu(), w, atol=ATOL, rtol=0)
