"""The `larimar` strategy: a needle sentence written among thousands comes back in the prompt
the LLM decoder sees, and the embedded model answers a pass key hidden in ~100K tokens."""

from __future__ import annotations

import random

import pytest
import torch

from engine.protocol import InvalidRequest, MemorySpec
from engine.sessions.larimar import LarimarParams, LarimarReader, parse_larimar_spec
from engine.sessions.larimar_prompt import (
    conditioned,
    reading_query,
    retrieved_sentences,
    split_context,
)
from memory_store.backends import EmbeddedBackend
from memory_store.client import in_process_client
from memory_store.larimar import LarimarConfig, LarimarHit
from tests.helpers import HAYSTACK_OBJECTS, HAYSTACK_VERBS
from tests.memory_store.conftest import HashingEncoder, minilm  # noqa: F401 (fixture)

FILLER = (
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)


def haystack(n: int, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    subjects = [
        "The river",
        "A quiet village",
        "The old library",
        "Every winter",
        "The market",
        "Our neighbour",
        "A small boat",
        "The orchestra",
        "The committee",
        "The road",
    ]
    verbs, objects = HAYSTACK_VERBS, HAYSTACK_OBJECTS
    return [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(n)]


# -- pure pieces ------------------------------------------------------------------------------


def test_spec_knobs_are_validated() -> None:
    assert parse_larimar_spec(None) == LarimarParams()
    params = parse_larimar_spec(MemorySpec("larimar", {"prefix_length": 3, "top_k": 1}))
    assert (params.prefix_length, params.top_k, params.use_prefix) == (3, 1, True)
    for bad in ({"k": 2}, {"top_k": 0}, {"prefix_length": "4"}, {"use_prefix": 1}):
        with pytest.raises(InvalidRequest) as e:
            parse_larimar_spec(MemorySpec("larimar", bad))
        assert e.value.param == f"memory.{next(iter(bad))}"


def test_query_and_context_follow_the_paper() -> None:
    prompt = (
        "The sky is blue. The pass key is 123. Remember it. What is the pass key? The pass key is"
    )
    assert reading_query(prompt) == "The pass key is"
    document, question = split_context(prompt)
    assert question == "The pass key is"
    assert document.endswith("What is the pass key?")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "The sky is blue. The code is 7. What is the code?"},
    ]
    assert reading_query(messages) == "What is the code?"
    document, short = split_context(messages)
    assert document == "The sky is blue. The code is 7."
    assert short == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the code?"},
    ]


def test_retrieved_sentences_are_distinct_in_document_order() -> None:
    hits = [
        LarimarHit(0, (5, 9), ("The key is 4.", "The key is 4."), 0.0),
        LarimarHit(1, (1, 6, 11), ("Grass is green.", "Grass is green.", "Grass is green."), 0.5),
    ]
    assert retrieved_sentences(hits, 16) == ["Grass is green.", "The key is 4."]
    assert retrieved_sentences(hits, 1) == ["The key is 4."]  # nearest slot kept first
    assert conditioned("The key is", ["The key is 4."]) == "The key is 4.\nThe key is"
    chat = conditioned([{"role": "user", "content": "What is the key?"}], ["The key is 4."])
    assert chat == [{"role": "user", "content": "The key is 4.\n\nWhat is the key?"}]


async def test_prefix_length_must_match_the_store(tmp_path) -> None:
    client = in_process_client(
        EmbeddedBackend(tmp_path), encoder=HashingEncoder(), larimar=LarimarConfig(prefix_length=4)
    )
    reader = LarimarReader(client)
    with pytest.raises(InvalidRequest) as e:
        reader.with_spec(MemorySpec("larimar", {"prefix_length": 3}))
    assert e.value.param == "memory.prefix_length"
    assert reader.with_spec(MemorySpec("larimar", {"top_k": 1})).params.top_k == 1


# -- with the sentence encoder ----------------------------------------------------------------


async def test_reader_finds_the_needle_in_a_haystack(minilm, tmp_path) -> None:
    sentences = haystack(1500)
    sentences.insert(1100, "The access code is 4417.")
    reader = LarimarReader.in_process(EmbeddedBackend(tmp_path), encoder=minilm)
    written = await reader.write("s1", " ".join(sentences))
    assert written == 1501

    prompt = await reader.conditioned_prompt("s1", "What is the access code? The access code is")
    assert "The access code is 4417." in prompt
    assert prompt.endswith("What is the access code? The access code is")
    assert len(prompt) < 2000  # a few sentences, not the document

    fresh = LarimarReader.in_process(EmbeddedBackend(tmp_path), encoder=minilm)  # from disk
    messages = [{"role": "user", "content": "What is the access code?"}]
    chat = await fresh.conditioned_prompt("s1", messages)
    assert "The access code is 4417." in chat[-1]["content"]


# -- with the embedded model ------------------------------------------------------------------


@pytest.mark.real_model
async def test_embedded_model_answers_the_pass_key_at_100k_tokens(
    minilm, tmp_path, real_loaded
) -> None:
    loaded = real_loaded
    tokenizer, model = loaded.tokenizer, loaded.model
    key = 71842
    per_filler = len(tokenizer(FILLER * 50, add_special_tokens=False).input_ids) / 50
    repeats = int(100_000 / per_filler)
    prompt = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
        "them. I will quiz you about the important information there."
        + FILLER * (repeats // 3)
        + f" The pass key is {key}. Remember it. {key} is the pass key."
        + FILLER * (repeats - repeats // 3)
        + " What is the pass key? The pass key is"
    )
    assert len(tokenizer(prompt).input_ids) > 95_000 > loaded.max_model_len

    document, question = split_context(prompt)
    reader = LarimarReader.in_process(EmbeddedBackend(tmp_path), encoder=minilm)
    await reader.write("passkey", document)
    short = await reader.conditioned_prompt("passkey", question)
    ids = tokenizer(short, return_tensors="pt").input_ids
    assert ids.shape[1] < 100

    with torch.inference_mode():
        out = model.generate(
            ids, max_new_tokens=7, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert str(key) in answer
