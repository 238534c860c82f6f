"""The larimar strategy through LocalEngine: a session's documents go to a Larimar memory, and a
question is answered from the sentences its readout identifies."""

from __future__ import annotations

import pytest

from engine.client import LocalEngine
from engine.config import EngineConfig
from engine.protocol import InvalidRequest, MemorySpec, PreparedPrompt, SamplingParams

NEEDLE = "The vault combination is written on the blue card."


@pytest.fixture
def engine(tiny_model_dir, tmp_path):
    engine = LocalEngine(EngineConfig(model=str(tiny_model_dir), data_dir=str(tmp_path)))
    yield engine


async def test_larimar_session_conditions_the_prompt_on_the_needle(engine, monkeypatch):
    await engine.create_session("s1", MemorySpec("larimar", {"top_k": 1}))
    haystack = " ".join(f"Sentence number {i} talks about the weather today." for i in range(50))
    progress = [p async for p in engine.ingest("doc-1", "s1", haystack + " " + NEEDLE)]
    assert progress[-1].done and progress[-1].tokens_done == progress[-1].tokens_total > 0

    seen = []
    original = engine.generate

    def spy(request_id, prompt, sampling, **kwargs):
        seen.append(prompt)
        return original(request_id, prompt, sampling, **kwargs)

    monkeypatch.setattr(engine, "generate", spy)
    deltas = [
        d
        async for d in original(
            "q-1",
            [{"role": "user", "content": "The vault combination is what?"}],
            SamplingParams(max_tokens=3, temperature=0),
            session_id="s1",
        )
    ]
    assert deltas[-1].finish_reason in ("stop", "length")
    assert deltas[-1].stats.strategy == "larimar"
    assert isinstance(seen[-1], PreparedPrompt)  # prepared off the loop, then generated
    conditioned = seen[-1].prompt
    assert NEEDLE in conditioned[-1]["content"]
    assert "The vault combination is what?" in conditioned[-1]["content"]
    assert "larimar" in engine.model.strategies
    await engine.drop_session("s1")
    await engine.shutdown()


async def test_bad_larimar_knob_is_refused(engine):
    with pytest.raises(InvalidRequest):
        await engine.create_session("s2", MemorySpec("larimar", {"top_k": 0}))
    await engine.shutdown()
