"""The text prior's lexical side (engine/memory/lexical.py, TextPrior with lexical=True): the
block that names what the question names outranks blocks the encoder scores alike
(docs/decisions/074-lexical-prior.md)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from engine.memory.config import parse_memory_spec
from engine.memory.lexical import BlockWords, names, words
from engine.memory.prior import TextPrior
from engine.protocol import InvalidRequest, MemorySpec

# token id -> word: ids 0..9 are filler, 10.. are invented names
FILLER = ("the", "ship", "was", "registered", "under", "number", "port", "records", "list", "it")
VOCAB = dict(enumerate(FILLER))


def decode(ids):
    return " ".join(VOCAB.get(i, f"name{i}") for i in ids)


class KindEncoder:
    """Every text holding 'ship' embeds alike, the rest elsewhere: a sentence encoder that sees
    the kind of a sentence and not the name in it."""

    dim = 2

    def embed(self, texts):
        return np.array([[1.0, 0.0] if "ship" in t else [0.0, 1.0] for t in texts], np.float32)


class FakeFrame:
    def __init__(self, n_memory: int) -> None:
        self.num_tokens, self.n_sinks, self.n_local, self.n_memory = n_memory, 0, 0, n_memory
        self.device = torch.device("cpu")


def test_words_are_lowercased_letters_and_digits_of_three_or_more():
    assert words("The ship Barrentor, no. 4411; a_b of X-ray") == {
        "the",
        "ship",
        "barrentor",
        "4411",
        "ray",
    }


def test_block_scores_are_the_share_of_the_questions_idf_weight():
    held = BlockWords()
    held.add([words("ship alpha"), words("ship beta"), words("filler only"), words("ship gamma")])
    scores = held.scores(words("which ship is beta"), 0, 4)
    assert scores.argmax() == 1 and scores[1] == pytest.approx(1.0)  # every word it has
    assert scores[2] == 0.0  # none of them
    assert 0 < scores[0] == scores[3] < 0.5  # the common word only: worth little
    assert held.scores(words("nothing matches"), 0, 4).tolist() == [0.0] * 4
    assert held.scores(words("beta"), 1, 2).tolist() == [1.0, 0.0]  # blocks from `first`


def test_a_copy_does_not_share_postings():
    held = BlockWords()
    held.add([words("ship alpha")])
    twin = held.copy()
    twin.add([words("ship beta")])
    assert len(held) == 1 and len(twin) == 2
    assert held.scores(words("beta"), 0, 1).tolist() == [0.0]


def _prior(lexical: bool, block: int = 4) -> TextPrior:
    # 8 blocks of 4 tokens; blocks 1, 3 and 6 are ship sentences naming ships 11, 13 and 16
    ids = []
    for b in range(8):
        ids += [1, 0, 10 + b, 2] if b in (1, 3, 6) else [8, 9, 4, 7]
    prior = TextPrior(KindEncoder(), decode, k=1, u=0, block=block, lexical=lexical)
    prior.read(torch.tensor(ids))
    return prior


def test_hybrid_pins_the_block_naming_the_questions_key():
    frame = FakeFrame(32)
    dense, hybrid = _prior(False), _prior(True)
    for prior in (dense, hybrid):
        prior.set_query("which ship is name16")
    picked = [(p.rows(frame).view(-1, 4)[:, 0] // 4).tolist() for p in (dense, hybrid)]
    assert picked == [[1], [6]]  # dense: the first of three alike; hybrid: the named one


def test_a_word_cut_at_a_block_border_counts_on_both_sides():
    prior = TextPrior(KindEncoder(), decode, k=1, u=0, block=16, lexical=True)
    ids = [8, 9, 4, 7] * 12
    ids[16] = 42  # the name opens block 1: block 0 reads it within its overlap, block 2 not
    prior.read(torch.tensor(ids))
    prior.set_query("name42")
    scores = prior.block_scores(FakeFrame(48))
    assert scores[0] == scores[1] > scores[2]


def test_a_forks_prior_keeps_its_own_words():
    prior = _prior(True)
    prior.set_query("name16")
    prior.rows(FakeFrame(32))
    twin = copy.deepcopy(prior)
    twin.read(torch.tensor([1, 0, 99, 2]))
    twin.set_query("ship name99")
    assert twin.block_scores(FakeFrame(36)).argmax() == 8
    assert len(prior._words) == 8


def test_prior_match_is_a_checked_knob_named_by_default():
    config = parse_memory_spec(MemorySpec("segments", {"prior_match": "dense"}), max_positions=8192)
    assert config.prior_match == "dense"
    named = parse_memory_spec(MemorySpec("segments", {"prior_match": "named"}), max_positions=8192)
    assert named.prior_match == "named"
    assert parse_memory_spec(MemorySpec("segments"), max_positions=8192).prior_match == "named"
    with pytest.raises(InvalidRequest) as e:
        parse_memory_spec(MemorySpec("segments", {"prior_match": "bm25"}), max_positions=8192)
    assert e.value.param == "memory.prior_match"


def _ship_prior(named: dict[int, int], k: int = 4) -> TextPrior:
    """8 blocks of 32 tokens, past any overlap; block b -> ship name id in `named` mid-block."""
    ids = []
    for b in range(8):
        middle = [1, 0, named[b], 2] if b in named else [8, 9, 4, 7]
        ids += [8, 9, 4, 7] * 3 + middle + [8, 9, 4, 7] * 4
    prior = TextPrior(KindEncoder(), decode, k=k, u=0, block=32, lexical=True)
    prior.read(torch.tensor(ids))
    return prior


def pinned_blocks(prior: TextPrior) -> list[int]:
    rows = prior.rows(FakeFrame(256))
    assert rows is not None
    return sorted((rows.view(-1, 32)[:, 0] // 32).tolist())


def test_hybrid_pins_only_the_blocks_near_the_best():
    # three ships of one kind: the question names one; the others are left out, not pinned
    prior = _ship_prior({1: 11, 3: 13, 6: 16})
    prior.set_query("which ship is name13")
    assert pinned_blocks(prior) == [3]
    # one ship named in three blocks (three values of one key): every one of them is pinned
    prior = _ship_prior({1: 11, 3: 11, 6: 11, 7: 12})
    prior.set_query("ship name11")
    assert pinned_blocks(prior) == [1, 3, 6]
    # no word of the question in the document: the k best, as the encoder alone ranks them
    prior.set_query("ship zzz")
    assert len(pinned_blocks(prior)) == 4


def test_names_are_a_questions_capitalized_words_past_a_sentence_start_and_its_numbers():
    assert names("What are all the badge numbers issued to the Zueldcor expedition?") == {
        "zueldcor"
    }
    assert names("Who signed? Which fee does Mira Tolk owe under clause 191?") == {
        "mira",
        "tolk",
        "191",
    }
    assert names("which ship is it") == frozenset()


def _worded_prior(middles: dict[int, list[int]], named: bool) -> TextPrior:
    """8 blocks of 32 tokens; block b holds the words `middles[b]` mid-block, filler elsewhere."""
    ids = []
    for b in range(8):
        ids += [8, 9, 4, 7] * 3 + middles.get(b, [8, 9, 4, 7]) + [8, 9, 4, 7] * 4
    prior = TextPrior(KindEncoder(), decode, k=4, u=0, block=32, lexical=True, named=named)
    prior.read(torch.tensor(ids))
    return prior


def test_named_keeps_every_block_naming_the_questions_key_in_other_words():
    # one ship (name11) in three blocks, worded differently: only block 1 says "registered
    # number"; block 4 names another ship in block 1's words. Hybrid's margin keeps block 1
    # alone; named keeps all three of name11's, and still not the other ship's.
    middles = {1: [1, 3, 5, 11], 3: [1, 0, 11, 2], 6: [1, 11, 2, 0], 4: [1, 3, 5, 14]}
    picked = []
    for named in (False, True):
        prior = _worded_prior(middles, named)
        prior.set_query("ship registered number name11")
        picked.append(pinned_blocks(prior))
    assert picked == [[1], [1, 3, 6]]


def test_a_document_s_words_are_read_as_its_blocks_reach_memory(tiny_loaded):
    """Like EmbD, a block's words are found when it moves to memory, not at the first question."""
    from engine.memory.session import SessionMemory

    spec = {"sinks": 8, "local_window": 64, "chunk_size": 32, "block": 16, "k": 1, "u": 0}
    spec["prior_match"] = "hybrid"
    memory = SessionMemory(tiny_loaded.model, MemorySpec("segments", spec))
    memory.attach_prior(KindEncoder(), decode)
    memory.append(torch.randint(100, 5000, (300,)), document=True)
    prior = memory.prior
    assert prior is not None and prior.num_embedded > 0
    assert len(prior._words) == prior.num_embedded
