"""Fixtures for engine tests: the real tokenizer of the embedded model around a tiny random
Llama (2 layers, hidden 64), saved to a directory so `load_model` loads it like any --model."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.runner.loader import LoadedModel, embedded_model_path, load_model
from tests.helpers import save_tiny_llama


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    gguf = embedded_model_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer, positions=256)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir) -> LoadedModel:
    return load_model(EngineConfig(model=str(tiny_model_dir), device="cpu"))


@pytest.fixture(scope="session")
def real_loaded() -> LoadedModel:
    """The embedded SmolLM2-135M as `longserve serve` loads it by default, loaded once for the
    run (tens of seconds on a shared CPU); tests read it, none changes its weights."""
    return load_model(EngineConfig(device="cpu"))


@pytest.fixture
async def make_engine(tiny_loaded):
    """Build LocalEngines on the shared tiny model; each is shut down after the test."""
    from engine.client import LocalEngine

    engines = []

    def make(loaded: LoadedModel | None = None, **config) -> LocalEngine:
        engine = LocalEngine(EngineConfig(device="cpu", **config), loaded=loaded or tiny_loaded)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.shutdown()


@pytest.fixture
async def engine(make_engine):
    return make_engine()


@pytest.fixture
def small_memory_spec():
    """Memory knobs whose frame fits the tiny model's 256-position window."""
    from engine.protocol import MemorySpec

    return MemorySpec(
        "segments",
        {"sinks": 8, "local_window": 64, "chunk_size": 32, "block": 16, "k": 2, "u": 1},
    )


@pytest.fixture
async def engines(tiny_model_dir, tmp_path):
    """make(store=None, **config) -> LocalEngine on its own copy of the tiny model, with an
    embedded store in tmp_path/data (or the given client); every engine is shut down after
    the test."""
    from engine.client import LocalEngine

    made = []

    def make(store=None, **config) -> LocalEngine:
        config.setdefault("data_dir", str(tmp_path / "data"))
        cfg = EngineConfig(model=str(tiny_model_dir), device="cpu", **config)
        engine = LocalEngine(cfg, loaded=load_model(cfg), store=store)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        await engine.shutdown()
