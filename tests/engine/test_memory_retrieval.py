"""Each strategy retrieves a planted token the last token must use, including generated ones.

The plant, for `segments` and `tokens`: a tiny Llama whose layer-0 query and key projections
map one embedding axis, used only by the PLANT and QUERY tokens, onto the slowest rotary pair,
so at layer 0 the planted token is the one memory token that scores highly against QUERY.
For `neurocache` (retrieval by layer-r hidden states): PLANT and QUERY share a large embedding
on that axis, so after layer 0 their hidden states are each other's nearest neighbours.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from engine.memory.session import SessionMemory
from engine.protocol import MemorySpec

from .test_memory_frame import tiny

VOCAB, PLANT, QUERY, AXIS = 400, 7, 9, 0
FRAME = dict(sinks=8, local_window=32, chunk_size=16, block=8)


def align_keys(model: LlamaForCausalLM, layer: int, strength: float = 10.0) -> None:
    """At `layer`, make the embedding AXIS write queries and keys along the slowest rotary
    pair of every head, so two AXIS tokens score highly at any distance."""
    attn = model.model.layers[layer].self_attn
    slow = torch.zeros(16)
    slow[[7, 15]] = 1.0  # head_dim 16: dims 7 and 15 rotate by ~1e-4 rad per position
    attn.k_proj.weight[:, AXIS] = strength * slow.repeat(2)
    attn.q_proj.weight[:, AXIS] = strength * slow.repeat(4)


def planted_model() -> LlamaForCausalLM:
    model = tiny("llama", vocab_size=VOCAB)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, AXIS] = 0.0
        embed[PLANT] = 0.0
        embed[PLANT, AXIS] = 1.0
        embed[QUERY, AXIS] = 0.5
        align_keys(model, 0)
    return model


def neurocache_model() -> LlamaForCausalLM:
    model = tiny("llama", vocab_size=VOCAB)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, AXIS] = 0.0
        embed[PLANT] = 0.0
        embed[PLANT, AXIS] = 50.0
        embed[QUERY] = embed[PLANT]
        embed[PLANT, AXIS + 1] = 20.0  # still QUERY's nearest state, but with its own value
        align_keys(model, 1, strength=1.0)  # layer 1 (above r=0) then attends to PLANT
        model.model.layers[1].self_attn.v_proj.weight[:, AXIS + 1] = 5.0  # ... and sees it
    return model


def document(length: int, plant_at: int | None, seed: int = 1) -> torch.Tensor:
    # Distinct tokens: no memory token is a near-duplicate of a chunk token by accident.
    ids = 20 + torch.randperm(VOCAB - 20, generator=torch.Generator().manual_seed(seed))[:length]
    if plant_at is not None:
        ids[plant_at] = PLANT
    ids[-1] = QUERY
    return ids


def read(memory: SessionMemory, ids: torch.Tensor) -> torch.Tensor:
    """The document, then QUERY alone, as a decode step: neurocache's per-token retrieval
    (a chunk's one retrieval ranks hits across all its tokens, and random tokens' states
    are each other's near-duplicates in a random model)."""
    memory.append(ids[:-1])
    return memory.append(ids[-1:])


SPECS = {
    "segments": MemorySpec("segments", dict(FRAME, k=1, u=0)),
    "segments-mean": MemorySpec("segments", dict(FRAME, k=1, u=0, score="mean")),
    "segments-head": MemorySpec("segments", dict(FRAME, k=1, u=0, select="head")),
    "tokens": MemorySpec("tokens", dict(FRAME, k=4, index="torch")),
    "tokens-faiss": MemorySpec("tokens", dict(FRAME, k=4, index="faiss-flat")),
    "neurocache": MemorySpec("neurocache", dict(FRAME, k=1, w=2, c=2, r=0)),
    "neurocache-pca": MemorySpec("neurocache", dict(FRAME, k=1, w=2, c=1, r=0, d=8, fit_tokens=64)),
}


def model_for(name: str) -> LlamaForCausalLM:
    return neurocache_model() if name.startswith("neurocache") else planted_model()


@pytest.mark.parametrize("name", list(SPECS))
def test_planted_token_is_retrieved_and_used(name):
    model = model_for(name)
    plant_at = 100  # memory index 92: far behind the local window when QUERY is read
    memory = SessionMemory(model, SPECS[name])
    with_plant = read(memory, document(300, plant_at))
    layer = 1 if name.startswith("neurocache") else 0  # neurocache: layers above r=0
    selected = memory._frame.last_selected[layer]  # (kv_heads, R)
    for head in range(2):
        assert plant_at - FRAME["sinks"] in selected[head].tolist()
    if name.startswith("segments"):
        assert selected.shape[1] == FRAME["block"]  # k=1, u=0: exactly the planted block
    if name.startswith("neurocache"):
        assert 0 not in memory._frame.last_selected  # layers <= r attend to no memory
        assert selected.shape[1] <= 2 * 2  # one hit, window w=2, c <= 2 retrievals

    without = read(SessionMemory(model, SPECS[name]), document(300, None))
    assert (with_plant - without).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["segments", "tokens", "neurocache"])
def test_generated_tokens_are_retrievable_later(name):
    """Turn 1 "generates" the PLANT token one step at a time; turn 2 retrieves it."""
    model = model_for(name)
    memory = SessionMemory(model, SPECS[name])
    memory.append(document(120, None, seed=2)[:-1])
    for token in (21, PLANT, 22):  # decode steps: appends of one token
        memory.append(torch.tensor([token]))
    generated_at = memory.num_tokens - 2
    read(memory, document(120, None, seed=3))  # turn 2: the plant leaves the window
    selected = memory._frame.last_selected[1 if name == "neurocache" else 0]
    for head in range(2):
        assert generated_at - FRAME["sinks"] in selected[head].tolist()
