"""Larimar memory: the two write solvers agree, reads find the needle, save/load round trip."""

from __future__ import annotations

import numpy as np
import pytest

from memory_store.backends import Backend
from memory_store.errors import NotFound
from memory_store.larimar import (
    LarimarConfig,
    LarimarMemory,
    LarimarStore,
    one_hot_weights,
    prefix_of,
    split_sentences,
    write_lstsq,
    write_one_hot,
)
from tests.helpers import HAYSTACK_OBJECTS, HAYSTACK_VERBS

from .conftest import HashingEncoder


def test_split_sentences() -> None:
    text = (
        'The grass is green. The sky is blue!  Is it? "Yes," he said. 9054 is the key.\n\n'
        "A heading without a stop\nDr. Who stays. e.g. this stays too"
    )
    assert split_sentences(text) == [
        "The grass is green.",
        "The sky is blue!",
        "Is it?",
        '"Yes," he said.',
        "9054 is the key.",
        "A heading without a stop Dr.",
        "Who stays. e.g. this stays too",
    ]
    assert split_sentences(" ".join(["word"] * 300), max_words=128)[2] == " ".join(["word"] * 44)
    assert split_sentences("   \n\n ") == []


def test_prefix_is_fixed_length_or_whole() -> None:
    assert prefix_of("The pass key is 732.", 4) == "The pass key is"
    assert prefix_of("Short one.", 4) == "Short one."


def test_lstsq_and_one_hot_agree_with_unique_keys() -> None:
    rng = np.random.default_rng(0)
    z = rng.standard_normal((40, 16)).astype(np.float32)
    slots = np.arange(40)
    m_fast = write_one_hot(slots, z, 40)
    m_lstsq = write_lstsq(one_hot_weights(slots, 40), z)
    np.testing.assert_array_equal(m_fast, z)  # W = I  =>  M = Z
    np.testing.assert_allclose(m_lstsq, m_fast, atol=1e-5)


def test_lstsq_and_one_hot_agree_with_shared_slots() -> None:
    rng = np.random.default_rng(1)
    z = rng.standard_normal((60, 16)).astype(np.float32)
    slots = rng.permutation(np.arange(60) % 13)  # 13 slots, several segments each
    w = one_hot_weights(slots, 13)
    np.testing.assert_allclose(write_lstsq(w, z), write_one_hot(slots, z, 13), atol=1e-5)
    np.testing.assert_allclose(write_lstsq(w, z), np.linalg.pinv(w) @ z, atol=1e-4)


@pytest.mark.parametrize("num_slots", [13, 300])  # the few-slot and the many-slot paths
def test_one_hot_write_is_the_per_slot_mean(num_slots: int) -> None:
    rng = np.random.default_rng(2)
    slots = rng.permutation(np.arange(3 * num_slots) % num_slots)
    z = rng.standard_normal((slots.shape[0], 8)).astype(np.float32)
    expected = np.stack([z[slots == k].mean(axis=0) for k in range(num_slots)])
    np.testing.assert_allclose(write_one_hot(slots, z, num_slots), expected, atol=1e-6)


@pytest.mark.parametrize("solver", ["one_hot", "lstsq"])
def test_memory_read_returns_the_written_segment(solver: str) -> None:
    enc = HashingEncoder()
    segs = [
        "The grass is green.",
        "The sky is blue.",
        "The pass key is 9054.",
        "The grass is green.",
        "Remember it well.",
    ]
    prefixes = [prefix_of(s, 4) for s in segs]
    mem = LarimarMemory(enc.dim, LarimarConfig(solver=solver))  # type: ignore[arg-type]
    mem.write(segs, enc.embed(segs), prefixes, enc.embed(prefixes))
    assert mem.num_segments == 5 and mem.num_slots == 4  # the repeat shares a slot
    hits = mem.read(enc.embed(["The pass key is"])[0], top_k=2)
    assert hits[0].texts == ("The pass key is 9054.",) and hits[0].distance < 1e-5
    np.testing.assert_allclose(mem.read_vector(hits[0].slot), mem.z[2], atol=1e-5)
    grass = mem.read(enc.embed(["The grass is green"])[0], top_k=1)[0]
    assert grass.segment_indices == (0, 3)


async def test_store_save_load_and_delete(backend: Backend) -> None:
    store = LarimarStore(backend, HashingEncoder())
    text = "Alpha beta gamma delta one. Alpha beta gamma epsilon two. The code is 42."
    assert await store.write("s1", text=text) == 3
    await store.save("s1")
    store.evict("s1")
    hits = await store.read("s1", "The code is what?", top_k=1)  # loads from the backend
    assert hits[0].texts == ("The code is 42.",)

    other = LarimarStore(backend, HashingEncoder())  # another replica
    mem = await other.load("s1")
    assert mem.segments == split_sentences(text)
    await other.delete("s1")
    with pytest.raises(NotFound):
        await LarimarStore(backend, HashingEncoder()).read("s1", "The code is", top_k=1)


async def test_needle_in_a_haystack(minilm, embedded_backend) -> None:
    """~2000 haystack sentences; the needle is found from a query sharing its 4-word prefix."""
    rng = np.random.default_rng(7)
    subjects = [
        "The river",
        "A quiet village",
        "The old library",
        "Every winter",
        "The committee",
        "Our neighbour",
        "The market",
        "A small boat",
        "The mountain road",
        "The orchestra",
    ]
    verbs = HAYSTACK_VERBS
    objects = [*HAYSTACK_OBJECTS, "the morning train", "the city walls"]
    tails = [
        "before dawn.",
        "for many years.",
        "without a word.",
        "in the rain.",
        "with great care.",
        "once again.",
        "near the coast.",
        "after dinner.",
    ]
    # 2000 sentences drawn from 300 distinct ones: their prefixes crowd the key memory as in a
    # real haystack, while the encoder (which skips repeats) stays fast on a shared CPU.
    pool = [
        f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}"
        for _ in range(300)
    ]
    haystack = [pool[i] for i in rng.integers(0, len(pool), size=2000)]
    needle = "The secret access code is 7319."
    position = 1234
    sentences = haystack[:position] + [needle] + haystack[position:]

    store = LarimarStore(embedded_backend, minilm)
    written = await store.write("haystack", text=" ".join(sentences))
    assert written == len(sentences)
    hits = await store.read("haystack", "The secret access code is", top_k=3)
    assert hits[0].texts == (needle,)
    assert hits[0].segment_indices == (position,)
    assert hits[0].distance < hits[1].distance
    # A plain question, matched by its whole encoding rather than its prefix, still ranks it.
    hits = await store.read(
        "haystack", "What is the secret access code?", top_k=3, use_prefix=False
    )
    assert needle in [t for h in hits for t in h.texts]
