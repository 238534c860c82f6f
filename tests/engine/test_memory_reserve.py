"""Room for a document's memory blocks taken before it is read (`SessionMemory.reserve`): one
allocation instead of doubling steps, the same logits, and a session headed past its RAM
budget goes to the disk tier before reading rather than after."""

from __future__ import annotations

import pytest
import torch

from engine.memory.buffers import GrowingBuffer
from engine.memory.mapped import DiskArena
from engine.memory.quantized import QuantizedBuffer
from engine.memory.session import SessionMemory
from engine.protocol import MemorySpec

from .test_memory_frame import tiny
from .test_memory_session import SMALL

CPU = torch.device("cpu")


def test_a_reserved_buffer_takes_its_rows_without_another_allocation():
    rows = GrowingBuffer(2, 8, torch.float16, CPU)
    rows.append(torch.ones(2, 10, 8, dtype=torch.float16))
    rows.reserve(1000)
    assert rows.data.shape[1] == 1010  # exactly, not the next power of two
    address = rows.data.data_ptr()
    x = torch.randn(2, 1000, 8).half()
    for start in range(0, 990, 33):
        rows.append(x[:, start : start + 33])
    rows.reserve(10)  # room enough already: nothing moves
    rows.append(x[:, 990:])
    assert rows.data.data_ptr() == address and torch.equal(rows.view()[:, 10:], x)


def test_a_quantized_buffer_reserves_its_codes_and_scales():
    rows = QuantizedBuffer(2, 64, 64, CPU)  # keys: a (scale, zero) per channel per 64 rows
    rows.reserve(640)
    codes, params = rows.codes.data.data_ptr(), rows.params.data.data_ptr()
    for _ in range(10):
        rows.append(torch.randn(2, 64, 64))
    assert rows.codes.data.data_ptr() == codes and rows.params.data.data_ptr() == params


def _address(rows) -> int:
    """Where a memory buffer's storage starts: its codes when quantized (int8)."""
    return (rows.codes if rows.quantized else rows).data.data_ptr()


@pytest.mark.parametrize("memory_dtype", ["int8", "float16"])
def test_a_session_that_reserved_reads_the_same_in_one_allocation(memory_dtype):
    model = tiny("llama")
    spec = MemorySpec("segments", dict(SMALL["segments"], memory_dtype=memory_dtype))
    ids = torch.randint(0, 300, (600,), generator=torch.Generator().manual_seed(9))
    plain, reserved = SessionMemory(model, spec), SessionMemory(model, spec)
    reserved.reserve(len(ids))
    layer = reserved._frame.layers[0]
    address = _address(layer.mem_k)
    plain.append(ids[:1], document=True)
    reserved.append(ids[:1], document=True)
    first = _address(plain._frame.layers[0].mem_k)
    for start in range(1, 600, 50):
        want = plain.append(ids[start : start + 50], document=True)
        got = reserved.append(ids[start : start + 50], document=True)
        assert torch.equal(got, want)
    assert reserved.memory_tokens == plain.memory_tokens > 400
    assert _address(layer.mem_k) == address  # no doubling step on the way
    assert _address(plain._frame.layers[0].mem_k) != first  # as without reserve


def test_a_document_that_would_pass_the_ram_budget_is_read_into_the_disk_tier(tmp_path):
    model = tiny("llama")
    arena = DiskArena(str(tmp_path), budget=1 << 26, max_rows=4096)
    memory = SessionMemory(model, MemorySpec("segments", SMALL["segments"]), arena=arena,
                           spill_bytes=40_000)  # fmt: skip
    memory.reserve(600)
    assert memory.on_disk  # before a token is read
    small = SessionMemory(model, MemorySpec("segments", SMALL["segments"]), arena=arena,
                          spill_bytes=40_000)  # fmt: skip
    small.reserve(10)
    assert not small.on_disk
