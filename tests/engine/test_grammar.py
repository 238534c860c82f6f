"""Structured outputs (engine/runner/grammar.py): whatever the model's logits, a constrained request's
text parses and matches its schema, on every path (plain, batched, a session through memory);
schemas llguidance cannot enforce are refused naming the feature. The tiny random Llama with
the real tokenizer: its logits are noise, so only the grammar makes the JSON."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.protocol import InvalidRequest, SamplingParams, StructuredOutput
from tests.engine.helpers import record_batches

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"enum": ["person", "company"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
FORMAT = StructuredOutput("json_schema", json.dumps(SCHEMA))


def check(text: str) -> dict:
    value = json.loads(text)
    assert isinstance(value, dict)
    assert set(value) >= {"name", "age", "kind"} and set(value) <= set(SCHEMA["properties"])
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert value["kind"] in ("person", "company")
    return value


async def answer(engine, request_id, prompt, sampling, **kwargs):
    deltas = [d async for d in engine.generate(request_id, prompt, sampling, **kwargs)]
    return "".join(d.text for d in deltas), deltas[-1].finish_reason


@pytest.mark.parametrize("seed", range(4))
async def test_sampled_output_matches_the_schema(make_engine, seed):
    engine = make_engine()
    sampling = SamplingParams(max_tokens=120, temperature=1.0, seed=seed, response_format=FORMAT)
    text, finish = await answer(engine, f"r{seed}", "Describe someone.", sampling)
    assert finish == "stop"
    check(text)


async def test_json_object_is_an_object(make_engine):
    engine = make_engine()
    fmt = StructuredOutput("json_object")
    sampling = SamplingParams(max_tokens=200, temperature=0.0, response_format=fmt)
    text, finish = await answer(engine, "o", "Give me JSON.", sampling)
    if finish == "stop":  # greedy noise may wander in a string until max_tokens
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length" and text.startswith("{")


async def test_a_batch_mixes_constrained_and_free_rows(make_engine):
    engine = make_engine(max_running_requests=4)
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=120, temperature=0.0, response_format=FORMAT)
    alone_free = await answer(engine, "f0", "Once upon a time,", free)
    alone_json = await answer(engine, "j0", "Describe someone.", constrained)
    sizes = record_batches(engine)
    together = await asyncio.gather(
        answer(engine, "f1", "Once upon a time,", free),
        answer(engine, "j1", "Describe someone.", constrained),
    )
    assert max(sizes) == 2
    assert together == [alone_free, alone_json]  # greedy: the same tokens batched or not
    check(alone_json[0])


async def test_a_session_answers_in_json_through_memory(make_engine):
    engine = make_engine()
    spec_knobs = {"sinks": 8, "local_window": 32, "chunk_size": 32, "block": 16, "k": 2}
    from engine.protocol import MemorySpec

    await engine.create_session("s", MemorySpec("segments", spec_knobs))
    [_ async for _ in engine.ingest("i", "s", " ".join(["orchard lantern copper"] * 60))]
    sampling = SamplingParams(max_tokens=120, temperature=0.7, seed=3, response_format=FORMAT)
    question = [{"role": "user", "content": "Who is in the document? Answer in JSON."}]
    text, finish = await answer(engine, "q", question, sampling, session_id="s")
    assert finish == "stop"
    check(text)
    assert engine._frame_backend.conversations["s"].memory.memory_tokens > 0  # read via memory


@pytest.mark.parametrize(
    ("schema", "feature"),
    [({"type": "array", "uniqueItems": True}, "uniqueItems"), ({"$ref": "#/$defs/x"}, "$defs")],
)
async def test_a_schema_it_cannot_enforce_is_refused_naming_why(make_engine, schema, feature):
    engine = make_engine()
    fmt = StructuredOutput("json_schema", json.dumps(schema))
    with pytest.raises(InvalidRequest, match=feature.replace("$", r"\$")) as refused:
        engine.generate("bad", "x", SamplingParams(response_format=fmt))
    assert refused.value.param == "response_format"


def test_compiled_grammars_are_cached(make_engine):
    from engine.runner.grammar import Grammars

    grammars = Grammars(make_engine()._tokenizer, 2, cache_size=1)
    first = grammars.compile(FORMAT)
    assert grammars.compile(FORMAT) is first and grammars.cache_hits == 1
    grammars.compile(StructuredOutput("json_object"))  # evicts FORMAT (cache_size 1)
    grammars.compile(FORMAT)
    assert grammars.compiled == 3
