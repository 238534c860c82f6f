"""Memory blocks' disk tier (engine/memory/mapped.py): file-backed buffers, tier "disk", and a
session that spills there once it passes its RAM budget.

What matters: the blocks really live in a file mapping (not the process's anonymous memory),
nothing is left on disk, the server-wide budget holds, and a session reads exactly the same
from disk as from RAM (same logits, forks and offloads included)."""

from __future__ import annotations

import gc
import itertools
import os

import httpx
import pytest
import torch

from engine.config import EngineConfig
from engine.memory.buffers import GrowingBuffer
from engine.memory.mapped import DiskArena, buffer, disk_arena, spilled
from engine.memory.session import SessionMemory
from engine.memory.strategies import STRATEGIES
from engine.protocol import InvalidRequest, MemoryBudgetExceeded, MemorySpec
from engine.sessions.tiers import spill_past_budget
from server.app import build_app
from server.settings import ServerSettings

from .helpers import complete_on_session
from .test_memory_frame import tiny
from .test_memory_session import SMALL, _run
from .test_session_turns import ask, collect, wait_for_tier

CPU = torch.device("cpu")


def mapped_from_file(tensor: torch.Tensor) -> bool:
    """Whether tensor's data lies in a mapping of one of the arena's (deleted) files."""
    address = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return len(fields) >= 6 and "longserve-blocks-" in fields[5]
    return False


def test_a_region_is_a_mapping_of_an_unlinked_file_taken_within_the_budget(tmp_path):
    arena = DiskArena(str(tmp_path), budget=4096, max_rows=1000)
    region = arena.region(2, 8, torch.float32)  # 64 bytes a row
    assert region.grow(64) and arena.used == 4096  # the whole budget
    region.data().fill_(3.0)
    assert mapped_from_file(region.data()) and float(region.data().sum()) == 3.0 * 2 * 64 * 8
    assert os.listdir(tmp_path) == []  # unlinked as soon as mapped
    assert not region.grow(65) and arena.used == 4096 and region.capacity == 64
    assert not arena.region(1, 1, torch.float32).grow(1)
    assert not DiskArena(str(tmp_path), 1 << 20, max_rows=10).region(1, 1, torch.uint8).grow(11)
    del region
    gc.collect()
    assert arena.used == 0


def test_a_buffer_on_disk_holds_and_takes_what_one_in_ram_does(tmp_path):
    arena = DiskArena(str(tmp_path), budget=1 << 24, max_rows=4096)
    ram, disk = (
        GrowingBuffer(2, 8, torch.float16, CPU),
        buffer(2, 8, torch.float16, CPU, arena=arena),
    )
    g = torch.Generator().manual_seed(0)
    for step in range(40):  # grows in place, drops from the front
        x = torch.randn(2, 37, 8, generator=g).half()
        ram.append(x)
        disk.append(x)
        if step % 3 == 2:
            ram.drop_front(50)
            disk.drop_front(50)
    assert disk.on_disk and mapped_from_file(disk.data) and not ram.on_disk
    assert disk.data.stride(0) == 4096 * 8  # heads max_rows apart: grown without a copy
    assert torch.equal(disk.view(), ram.view())
    idx = torch.randint(0, ram.size, (2, 11), generator=g)
    assert torch.equal(disk.take(idx), ram.take(idx))
    disk.to(CPU)  # stays in its mapping
    assert mapped_from_file(disk.data)
    for _ in range(120):  # past max_rows: the live rows move to the region's front
        x = torch.randn(2, 37, 8, generator=g).half()
        ram.append(x)
        disk.append(x)
        ram.drop_front(37)
        disk.drop_front(37)
    assert disk.on_disk and torch.equal(disk.view(), ram.view())
    moved = spilled(ram, arena)
    assert moved is not None and moved.on_disk and torch.equal(moved.view(), ram.view())


def test_a_full_arena_leaves_a_buffer_growing_in_ram(tmp_path):
    arena = DiskArena(str(tmp_path), budget=256 * 8 * 2, max_rows=4096)  # 256 rows
    rows = buffer(1, 8, torch.float16, CPU, arena=arena)
    x = torch.arange(300 * 8, dtype=torch.float16).view(1, 300, 8)
    rows.append(x[:, :200])
    assert rows.on_disk
    rows.append(x[:, 200:])  # past the budget: RAM, no error, nothing lost
    assert not rows.on_disk and torch.equal(rows.view(), x)
    gc.collect()
    assert arena.used == 0


@pytest.mark.parametrize(
    ("strategy", "memory_dtype"), [(s, "auto") for s in STRATEGIES] + [("segments", "int8")]
)
def test_a_session_on_disk_reads_exactly_as_in_ram(tmp_path, strategy, memory_dtype):
    model = tiny("llama")
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(9))
    knobs = dict(SMALL[strategy], memory_dtype=memory_dtype)
    want = _run(SessionMemory(model, MemorySpec(strategy, knobs)), ids)
    arena = DiskArena(str(tmp_path), budget=1 << 26, max_rows=4096)
    disk = SessionMemory(model, MemorySpec(strategy, dict(knobs, tier="disk")), arena=arena)
    got = _run(disk, ids)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    layer = disk._frame.layers[0]
    held = layer.mem_k.codes if memory_dtype == "int8" else layer.mem_k
    assert disk._frame.on_disk and mapped_from_file(held.data) and arena.used > 0

    fork = disk.fork()  # a copy on disk too, sharing the budget
    assert fork._frame.arena is arena and fork._frame.on_disk
    disk.offload()
    disk.reload()
    assert disk._frame.on_disk
    after = disk.append(torch.tensor([5]))  # an offload drops step caches: within 1e-4, as RAM
    torch.testing.assert_close(after, fork.append(torch.tensor([5])), atol=1e-4, rtol=0)
    del disk, fork, layer, held
    gc.collect()
    assert arena.used == 0


def test_a_session_past_its_ram_budget_spills_and_reads_the_same(tmp_path):
    model = tiny("llama")
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(9))
    spec = MemorySpec("segments", SMALL["segments"])
    arena = DiskArena(str(tmp_path), budget=1 << 26, max_rows=4096)
    ram = SessionMemory(model, spec)
    spills = SessionMemory(model, spec, arena=arena, spill_bytes=40_000)
    assert torch.equal(spills.append(ids[:150]), ram.append(ids[:150]))
    assert not spills._frame.on_disk  # under the budget: RAM
    want, got = _run(ram, ids[150:]), _run(spills, ids[150:])
    assert spills._frame.on_disk and spills._frame.memory_nbytes() > 40_000
    assert not ram._frame.on_disk
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_full_disk_tier_is_tried_again_only_after_a_quarter_more_blocks(tmp_path, monkeypatch):
    """A failed spill copies layers before it finds the tier full: it is not tried again at
    every block move, only once the blocks have grown by a quarter."""
    from engine.memory.frame_state import FrameState

    tries: list[int] = []
    spill = FrameState.spill

    def counted(self):
        tries.append(self.memory_nbytes())
        return spill(self)

    monkeypatch.setattr(FrameState, "spill", counted)
    model = tiny("llama")
    arena = DiskArena(str(tmp_path), budget=4096, max_rows=4096)  # too small for any layer
    memory = SessionMemory(model, MemorySpec("segments", SMALL["segments"]), arena=arena,
                           spill_bytes=10_000)  # fmt: skip
    ids = torch.randint(0, 300, (600,), generator=torch.Generator().manual_seed(9))
    sizes_over = set()  # the distinct sizes the blocks had past spill_bytes: one per move
    for start in range(0, 600, 4):
        memory.append(ids[start : start + 4])
        if memory.memory_nbytes() > 10_000:
            sizes_over.add(memory.memory_nbytes())
    assert not memory.on_disk and len(tries) >= 2
    assert all(later >= earlier * 5 / 4 for earlier, later in itertools.pairwise(tries))
    assert len(tries) * 3 < len(sizes_over)


def test_tier_disk_without_a_disk_tier_is_an_invalid_request():
    spec = MemorySpec("segments", dict(SMALL["segments"], tier="disk"))
    with pytest.raises(InvalidRequest) as err:
        SessionMemory(tiny("llama"), spec)
    assert err.value.param == "memory.tier"


def test_the_engine_s_disk_tier_follows_its_settings(tmp_path):
    assert disk_arena(EngineConfig(memory_disk_bytes=0)) is None
    arena = disk_arena(EngineConfig(data_dir=str(tmp_path), memory_disk_bytes=1 << 20))
    assert arena is not None and arena.directory == str(tmp_path / "blocks")
    assert arena.budget == 1 << 20
    with pytest.raises(ValueError):
        EngineConfig(session_ram_bytes=-1)


async def test_a_session_on_disk_over_http(make_engine, tmp_path):
    """memory.tier "disk" through the API: the session answers, shows tier "disk", the
    gauges count it; a server without a disk tier refuses the knob with a 400."""
    engine = make_engine(memory_disk_dir=str(tmp_path), memory_disk_bytes=1 << 26)
    app = build_app(ServerSettings(api_keys=["k"]), engine)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    memory = {"strategy": "segments", "sinks": 8, "local_window": 64, "chunk_size": 32,
              "block": 16, "k": 2, "u": 1, "tier": "disk"}  # fmt: skip
    async with httpx.AsyncClient(
        transport=transport, base_url="http://test", headers={"Authorization": "Bearer k"}
    ) as http:
        made = await http.post("/v1/sessions", json={"memory": memory})
        assert made.status_code == 200, made.text
        session_id = made.json()["id"]
        answer = await complete_on_session(http, engine.model.id, session_id)
        assert answer.status_code == 200, answer.text
        shown = (await http.get(f"/v1/sessions/{session_id}")).json()
        metrics = (await http.get("/metrics")).text
    assert shown["memory"]["tier"] == "disk"
    assert "longserve:sessions_on_disk 1.0" in metrics
    assert engine.stats().memory_disk_bytes > 0

    off = make_engine(memory_disk_bytes=0)
    app = build_app(ServerSettings(api_keys=["k"]), off)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://test", headers={"Authorization": "Bearer k"}
    ) as http:
        refused = await http.post("/v1/sessions", json={"memory": memory})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "memory.tier"


async def test_idle_sessions_past_the_server_s_ram_budget_move_to_disk_and_answer_the_same(
    make_engine, small_memory_spec, tmp_path
):
    """memory_ram_bytes: housekeeping moves idle sessions' blocks to the disk tier, least
    recently used first, never a busy one; their answers do not change."""
    spills = make_engine(
        memory_disk_dir=str(tmp_path), memory_ram_bytes=1, session_offload_after_s=0.2
    )
    stays = make_engine(memory_ram_bytes=0, session_offload_after_s=0)
    for engine in (spills, stays):
        for sid in ("s1", "s2"):
            await engine.create_session(sid, small_memory_spec)
            await collect(engine.ingest(f"i{sid}", sid, "The access code is 4721. " * 20))
    await wait_for_tier(spills, "s1", "disk")
    await wait_for_tier(spills, "s2", "disk")
    assert spills.stats().sessions_on_disk == 2 and stays.stats().sessions_on_disk == 0
    question = [{"role": "user", "content": "Code?"}]
    answers = [await ask(e, "a", question, session_id="s1") for e in (spills, stays)]
    assert answers[0][0] == answers[1][0]

    sessions = stays._frame_backend.conversations  # busy ones stay; least recently used first
    arena = DiskArena(str(tmp_path), 1 << 26, 4096)
    for session in sessions.values():
        session.memory._frame.arena = arena
    spill_past_budget(sessions, busy={"s1", "s2"}, budget=1)
    assert not any(s.memory.on_disk for s in sessions.values())
    spill_past_budget(sessions, busy={"s2"}, budget=1)
    assert sessions["s1"].memory.on_disk and not sessions["s2"].memory.on_disk
    sessions["s2"].last_used = 0.0  # now the least recently used: it goes, s1 is there already
    spill_past_budget(sessions, busy=set(), budget=1)
    assert sessions["s2"].memory.on_disk


async def test_a_document_the_disk_tier_cannot_take_is_refused_before_it_is_read(
    make_engine, small_memory_spec, tmp_path
):
    """Past session_ram_bytes a document needs room in the disk tier; without it the ingest
    fails with MemoryBudgetExceeded and the session holds what it held."""
    engine = make_engine(memory_disk_dir=str(tmp_path), memory_disk_bytes=4096, session_ram_bytes=1)
    await engine.create_session("s", small_memory_spec)
    memory = engine._frame_backend.conversations["s"].memory
    with pytest.raises(MemoryBudgetExceeded) as err:
        await collect(engine.ingest("i", "s", "The access code is 4721. " * 20))
    assert err.value.room == 4096 and err.value.needed > 4096
    assert memory.num_tokens == 0 and not memory.on_disk


def test_the_prefix_cache_keeps_its_copies_in_the_disk_tier(tmp_path):
    """A long prompt's kept memory (engine/caches/prefix_cache.py) moves its blocks to disk:
    kept copies in RAM took a 24 GB server out of memory at 128K (decision 077)."""
    from engine.caches.prefix_cache import PrefixCache

    arena = DiskArena(str(tmp_path), budget=1 << 26, max_rows=4096)
    memory = SessionMemory(tiny("llama"), MemorySpec("segments", SMALL["segments"]), arena=arena)
    memory.append(torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(1)))
    cache = PrefixCache(1 << 30)
    cache.put("tenant", memory)
    [entry] = cache._entries.values()
    assert entry.memory._frame.on_disk and not memory._frame.on_disk


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's smaps")
def test_a_regions_mapping_is_advised_random(tmp_path):
    """No readahead into the sparse files (decision 102): the kernel marks the mapping `rr`."""
    region = DiskArena(str(tmp_path), 1 << 30, 4096).region(2, 64, torch.float16)
    start = region.storage.data_ptr()
    flags = None
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                low, high = (int(x, 16) for x in first.split("-"))
                inside = low <= start < high
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
                break
    assert flags is not None and "rr" in flags
