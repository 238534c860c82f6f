"""A model load parses its GGUF once (engine/runner/gguf_once.py): transformers' tokenizer,
config and weights and gguf_grids' readers share one reader, and gguf is left as it was;
the load runs on one thread (two side by side, each with a pool, ran five times slower)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from engine.config import EngineConfig
from engine.runner.gguf_once import parsed_once
from engine.runner.loader import load_model
from tests.engine.test_gguf_grids import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf-once") / "tiny.gguf")


def test_one_reader_per_file_inside_and_gguf_restored_after(tiny_gguf):
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError), parsed_once():
        first = gguf.GGUFReader(tiny_gguf)
        assert gguf.GGUFReader(str(tiny_gguf)) is first  # a str or a Path: the same file
        assert isinstance(first, reader) and "blk.0.attn_q.weight" in {
            t.name for t in first.tensors
        }
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        raise RuntimeError("a load that fails still puts gguf back")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)


def test_a_gguf_model_load_parses_the_file_once(tiny_gguf, monkeypatch):
    parsed: list[str] = []

    class Counting(gguf.GGUFReader):  # type: ignore[misc]
        def __init__(self, path, mode="r"):
            parsed.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    loaded = load_model(EngineConfig(model=str(tiny_gguf)))
    assert loaded.linear_dtype == "gguf"  # gguf_grids read the file's types and blocks too
    assert parsed == [str(tiny_gguf)]
    assert gguf.GGUFReader is Counting


def test_a_load_runs_on_one_thread_and_gives_the_pool_back(monkeypatch):
    import torch

    from engine.runner import loader

    seen: list[int] = []

    def load(*args):
        seen.append(torch.get_num_threads())
        raise RuntimeError("a load that fails gives the threads back too")

    monkeypatch.setattr(loader, "_from_pretrained", load)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError):
            load_model(EngineConfig())
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
