"""Collections (Decoupled Context Processing): chunks pre-encoded by `longserve ingest`, attached
to a session with no model forward; a collection too large to load whole is searched per
request, EmbQ(last user message) . EmbD(chunk) picking the chunks read into that request's fork
of the session's memory."""

from __future__ import annotations

import argparse

import pytest
import torch

import memory_store.embedder
from engine.caches import ingest_cli
from engine.client import LocalEngine
from engine.config import EngineConfig
from engine.memory.session import SessionMemory
from engine.memory.strategies import STRATEGIES
from engine.protocol import (
    CollectionIncompatible,
    CollectionNotFound,
    InvalidRequest,
    MemorySpec,
    SamplingParams,
)
from engine.runner.chat_template import assistant_turn_end
from engine.runner.loader import load_model
from engine.sessions.prior_query import prior_query
from tests.engine.helpers import ingest_args
from tests.memory_store.conftest import minilm  # noqa: F401 - a fixture

from .test_memory_frame import tiny
from .test_memory_session import SMALL
from .test_store_integration import SPEC

TOPICS = {
    "vault.txt": "The vault access code is 4721 and the vault door is made of thick steel. ",
    "fruit.txt": "Bananas are sweet yellow fruits that grow in warm tropical countries. ",
    "train.txt": "The night train to Paris leaves at noon from platform nine every day. ",
}
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture
async def collection(tiny_model_dir, tmp_path, monkeypatch, minilm):  # noqa: F811
    """`longserve ingest --collection manuals` of three one-topic files, with the real MiniLM
    as EmbD; returns the per-file summaries."""
    monkeypatch.setattr(memory_store.embedder, "default_embedder", lambda: minilm)
    files = []
    for name, sentence in TOPICS.items():
        path = tmp_path / name
        path.write_text(sentence * 4, encoding="utf-8")
        files.append(str(path))
    parser = argparse.ArgumentParser()
    ingest_cli.add_arguments(parser)
    args = parser.parse_args(ingest_args(files, tmp_path / "data", tiny_model_dir, SPEC, "manuals"))
    return await ingest_cli.ingest_files(args)


@pytest.fixture
async def engines(tiny_model_dir, tmp_path, minilm):  # noqa: F811
    made = []

    def make(**config) -> LocalEngine:
        cfg = EngineConfig(
            model=str(tiny_model_dir), device="cpu", data_dir=str(tmp_path / "data"), **config
        )
        engine = LocalEngine(cfg, loaded=load_model(cfg))
        engine._frame_backend.collections.query_encoder = minilm
        made.append(engine)
        return engine

    yield make
    for engine in made:
        await engine.shutdown()


def count_forwards(engine: LocalEngine) -> list[int]:
    forwards: list[int] = []
    engine.loaded.model.register_forward_hook(lambda *a: forwards.append(1))
    return forwards


async def test_ingest_stores_minilm_embeddings(collection, engines, minilm):  # noqa: F811
    engine = engines()
    bridge = engine._store
    refs = await bridge.acall("list", lambda: bridge.client.collection_chunks("manuals"))
    assert len(refs) == sum(r["chunks"] for r in collection) >= 6
    # EmbD(c) is MiniLM of the chunk's text: the chunk scores ~1 against its own text.
    chunk = bridge.get_chunk(refs[0].fingerprint, refs[0].chain_hash)
    hits = await bridge.acall(
        "select", lambda: bridge.client.select_chunks("manuals", minilm.embed([chunk.text])[0], 1)
    )
    assert hits[0].chain_hash == refs[0].chain_hash and hits[0].score == pytest.approx(1, abs=1e-4)


async def test_small_collection_loads_whole_with_zero_forwards(collection, engines):
    engine = engines()
    await engine.create_session("s", SPEC)
    forwards = count_forwards(engine)
    attached = await engine.attach_collection("s", "manuals")
    assert attached.loading == "whole" and attached.chunks == sum(r["chunks"] for r in collection)
    assert attached.tokens == sum(r["tokens"] for r in collection)
    assert engine.stats().memory_tokens == attached.tokens
    assert not forwards
    assert await engine.attach_collection("s", "manuals") == attached  # idempotent
    assert engine.stats().memory_tokens == attached.tokens
    deltas = [d async for d in engine.generate("g", "What is the code?", GREEDY, session_id="s")]
    assert deltas[-1].finish_reason == "length"


async def test_large_collection_loads_the_chunks_the_query_selects(collection, engines):
    engine = engines(collection_max_chunks=2, collection_top_k=1)
    await engine.create_session("s", SPEC)
    attached = await engine.attach_collection("s", "manuals")
    assert attached.loading == "selected" and attached.tokens == 0
    assert engine.stats().memory_tokens == 0

    selections: list[list[str]] = []
    collections = engine._frame_backend.collections
    select = collections._select

    async def spy(session, prompt):
        chunks = await select(session, prompt)
        selections.append([c.text for c in chunks])
        return chunks

    collections._select = spy
    forwards = count_forwards(engine)
    for question, word in (
        ("What is the access code of the vault?", "vault"),
        ("Which fruits are yellow and sweet?", "Bananas"),
        ("When does the train to Paris leave?", "train"),
    ):
        messages = [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": question},
        ]
        prompt_tokens = len(engine.encode_prompt(messages))
        deltas = [d async for d in engine.generate("g", messages, GREEDY, session_id="s")]
        assert deltas[-1].finish_reason == "length"
        assert len(selections[-1]) == 1 and word in selections[-1][0], selections[-1]
        # The session keeps the turn (closed with the template's end of turn), never the
        # selected chunks. Each request sends a new conversation: the memory forgets the one
        # before (it holds no documents) and reads it as sent.
        assert deltas[-1].prompt_tokens == prompt_tokens
        closing = assistant_turn_end(engine._tokenizer)
        ended = deltas[-1].token_ids[-1:] == closing[:1]
        assert engine.stats().memory_tokens == (
            prompt_tokens + GREEDY.max_tokens + len(closing) - ended
        )
    # Only the prompts and generated tokens ran through the model (chunks were imported).
    assert forwards


async def test_attach_errors_change_nothing(collection, engines):
    engine = engines()
    await engine.create_session("s", SPEC)
    with pytest.raises(CollectionNotFound):
        await engine.attach_collection("s", "no-such-collection")
    with pytest.raises(InvalidRequest):
        await engine.attach_collection("s", "bad name!")
    other = MemorySpec("segments", dict(SPEC.params, k=1))
    await engine.create_session("other", other)
    with pytest.raises(CollectionIncompatible, match="another model or memory configuration"):
        await engine.attach_collection("other", "manuals")
    assert engine.stats().memory_tokens == 0
    assert engine._frame_backend.conversations["other"].collections == {}


def test_the_collection_query_is_the_last_question_then_the_answer_before_it():
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "second"}]},
        {"role": "assistant", "content": "b"},
    ]
    assert prior_query(messages) == "second\na"
    assert prior_query("a completion prompt") == "a completion prompt"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fork_is_independent_and_shares_the_model(strategy):
    model = tiny("llama")
    memory = SessionMemory(model, MemorySpec(strategy, SMALL[strategy]))
    memory.append(torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(1)))
    fork = memory.fork()
    assert fork.model is model
    prompt = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(fork.append(prompt), memory.append(prompt), atol=0, rtol=0)
    assert fork.state_hash == memory.state_hash
    fork.append(torch.tensor([5]))
    assert fork.num_tokens == memory.num_tokens + 1  # the session did not see the fork's token
