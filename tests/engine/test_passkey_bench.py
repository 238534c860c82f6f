"""bench/passkey.py reads the opening a cell's prompts share once and forks it: the answers
and final logits must be exactly those of reading every prompt whole."""

from __future__ import annotations

import pytest
import torch

from bench.passkey import answer_with_memory, answers_sharing_prefix, decode_answer
from engine.memory.session import SessionMemory
from engine.protocol import MemorySpec

from .test_memory_frame import tiny
from .test_text_prior import WordEncoder, words

FRAME = dict(sinks=8, local_window=32, chunk_size=16, block=8, tail=4, read_window=16)
SPECS = {
    "segments": dict(FRAME, k=2, u=1),
    "tokens": dict(FRAME, k=8),
    "neurocache": dict(FRAME, k=4, fit_tokens=32),
}


class Ids:
    """A stand-in tokenizer: decode writes the ids."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return " ".join(map(str, ids))


@pytest.mark.parametrize("strategy", list(SPECS))
def test_shared_prefix_gives_the_answers_of_whole_prompts(strategy):
    model = tiny("llama")
    filler = torch.randint(10, 300, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    # needles at growing depths in the same filler; lengths differ a little, as keys do
    prompts = [
        filler[:at] + [1, 2, 3 + i] + filler[at:] + [4, 5]
        for i, at in enumerate((37, 120, 121, 250, 395))
    ]
    spec = MemorySpec(strategy, SPECS[strategy])
    shared = {
        i: (text, memory)
        for i, text, memory in answers_sharing_prefix(model, Ids, prompts, spec, new_tokens=3)
    }
    assert sorted(shared) == list(range(len(prompts)))
    for i, ids in enumerate(prompts):
        text, memory = answer_with_memory(model, Ids, ids, spec, new_tokens=3)
        assert shared[i][0] == text
        torch.testing.assert_close(
            shared[i][1].append(torch.tensor([7])),
            memory.append(torch.tensor([7])),
            atol=1e-5,
            rtol=0,
        )
        assert shared[i][1].num_tokens == memory.num_tokens


def test_served_answers_sharing_a_prefix_are_those_of_whole_prompts():
    """--served: the text prior attached, the body an inline document as the server cuts it,
    contrast's bare row on; forking the shared opening still changes no answer."""
    model = tiny("llama")
    filler = torch.randint(10, 300, (400,), generator=torch.Generator().manual_seed(2)).tolist()
    prompts = [filler[:at] + [1, 2, 3 + i] + filler[at:] + [4, 5] for i, at in enumerate((60, 200))]
    spec = MemorySpec("segments", dict(SPECS["segments"], prior_k=1, prior_u=0, contrast=0.5))
    prior = (WordEncoder(), words)
    shared = {
        i: text for i, text, _ in answers_sharing_prefix(model, Ids, prompts, spec, 3, prior=prior)
    }
    for i, ids in enumerate(prompts):
        memory = SessionMemory(model, spec)
        memory.attach_prior(*prior)
        with torch.inference_mode():
            text, _ = decode_answer(Ids, memory, ids, 3, Ids.decode(ids[-64:]))
        assert shared[i] == text
