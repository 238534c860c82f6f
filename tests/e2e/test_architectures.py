"""The families people run, each as a tiny random model saved with `save_pretrained` and passed
to `longserve serve --model` (a real server process), through the openai SDK: chat, streaming,
a prompt longer than the window, a session, each memory strategy, json_schema, tools in the
family's own format, and greedy logprobs equal to transformers' own forward of the same
weights (the lean decode step where the family has one; Gemma 2 keeps transformers' forward).

Each model carries the embedded tokenizer with its family's real chat template where one is in
tests/engine/chat_templates.py (the ChatML one with Hermes tools elsewhere)."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from engine.runner.detokenize import token_text
from tests.engine import chat_templates
from tests.engine.test_tool_formats import WEATHER

from .conftest import API_KEY, ServerProcess, start_server, stop_server

WINDOW = 4096  # room for the default frames (segments: 3,136 positions)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=WINDOW,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


def _config(family: str, ids: dict[str, int]) -> Any:
    """(config) for `family`: `ids` are the tokenizer's vocab size and special ids."""
    import transformers as t

    common = {**TINY, **ids}
    if family == "llama-3.1":
        return t.LlamaConfig(**common, rope_parameters=LLAMA3_ROPE)
    if family == "qwen2":
        return t.Qwen2Config(**common)
    if family == "qwen3":
        return t.Qwen3Config(**common, head_dim=24)
    if family == "mistral":
        return t.MistralConfig(**common, sliding_window=None)
    if family == "phi3":
        return t.Phi3Config(**common)
    # Soft-capped attention is refused at load (decision 065): Gemma 2 without it, whose
    # sliding window (half the positions) becomes the served window.
    return t.Gemma2Config(
        **common, head_dim=16, attn_logit_softcapping=None, sliding_window=WINDOW // 2
    )


TEMPLATES = {
    "llama-3.1": chat_templates.LLAMA_3_1,
    "qwen2": chat_templates.QWEN_2_5,
    "qwen3": chat_templates.QWEN_2_5,
    "mistral": chat_templates.MISTRAL_V0_3,
    "phi3": None,  # the embedded ChatML template: the Hermes fallback for tools
    "gemma2": None,
}
FAMILIES = list(TEMPLATES)
LEAN = {f for f in FAMILIES if f != "gemma2"}

pytestmark = pytest.mark.timeout(600)

FLAGS = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
WORDS = [
    "the",
    "copper",
    "vault",
    "opens",
    "at",
    "noon",
    "while",
    "seven",
    "lanterns",
    "burn",
    "near",
    "the",
    "northern",
    "gate",
]


def prose(n_words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] + ("." if i % 17 == 16 else "") for i in range(n_words))


def save_family(family: str, path: Path, tokenizer: Any) -> Path:
    import transformers as t

    ids = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.eos_token_id,
    }
    config = _config(family, ids)
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # biases and norm weights drawn, so a missed one shows
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    templated = copy.deepcopy(tokenizer)
    if TEMPLATES[family] is not None:
        templated.chat_template = TEMPLATES[family]
    templated.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from engine.runner.loader import embedded_model_path

    gguf = embedded_model_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory, tokenizer) -> Iterator[tuple[str, Path, ServerProcess]]:
    family = request.param
    root = tmp_path_factory.mktemp(family)
    path = save_family(family, root / "model", tokenizer)
    server = start_server(root, "--model", str(path), "--threads", "2", "--log-level", "info")
    yield family, path, server
    stop_server(server)


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[2].api_base, api_key=API_KEY, max_retries=0)


def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat(client: openai.OpenAI, content: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=model_id(client),
        messages=[{"role": "user", "content": content}],
        temperature=0,
        **extra,
    )


def test_the_lean_step_is_taken_where_the_family_has_one(served):
    family, _, server = served
    kept = "decode steps keep transformers' forward" in server.log_path.read_text()
    assert kept == (family not in LEAN), server.log()


def test_greedy_logprobs_are_transformers_forward(served, client, tokenizer):
    """A token-id prompt, 6 greedy tokens: each one and its logprob as transformers' forward
    of the whole sequence gives them (fp32 weights, the server's defaults)."""
    import transformers as t

    _, path, _ = served
    prompt = tokenizer(prose(60))["input_ids"]
    got = client.completions.create(
        model=model_id(client), prompt=prompt, max_tokens=6, temperature=0, logprobs=1
    )
    reference = t.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ids, expected, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(6):
            logits = reference(torch.tensor([ids])).logits[0, -1].double()
            step = torch.log_softmax(logits, -1)
            top = int(step.argmax())
            expected.append(token_text(tokenizer, top))
            logprobs.append(float(step[top]))
            ids.append(top)
    lp = got.choices[0].logprobs
    assert lp.tokens == expected
    assert all(
        math.isclose(a, b, abs_tol=2e-3) for a, b in zip(lp.token_logprobs, logprobs, strict=True)
    )


def test_chat_and_its_stream_agree(client):
    whole = chat(client, "Say something.", max_tokens=12)
    assert whole.usage.completion_tokens == 12 or whole.choices[0].finish_reason == "stop"
    pieces = chat(client, "Say something.", max_tokens=12, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text == whole.choices[0].message.content


@pytest.mark.parametrize("strategy", ["segments", "tokens", "neurocache"])
def test_a_prompt_longer_than_the_window_goes_through_each_strategy(served, client, strategy):
    question = prose(5000) + "\n\nWhen does the copper vault open?"
    reply = chat(client, question, max_tokens=8, extra_body={"memory": {"strategy": strategy}})
    assert reply.usage.prompt_tokens > WINDOW
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1


def test_a_session_reads_a_document_and_answers_two_turns(served, client):
    server = served[2]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.api_base, headers=headers, timeout=120) as http:
        session = http.post("/sessions", json={}).json()
        doc = http.post(
            f"/sessions/{session['id']}/documents", json={"name": "a.txt", "text": prose(5000)}
        )
        assert doc.status_code == 200, doc.text
    messages: list[dict[str, Any]] = []
    for question in ("When does the copper vault open?", "And the gate?"):  # one conversation
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(
            model=model_id(client),
            messages=messages,
            temperature=0,
            max_tokens=8,
            extra_body={"session_id": session["id"]},
        )
        assert reply.usage.completion_tokens >= 1
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    with httpx.Client(base_url=server.api_base, headers=headers, timeout=60) as http:
        view = http.get(f"/sessions/{session['id']}").json()
    assert view["turns"] == 2 and view["memory_tokens"] > WINDOW, json.dumps(view)


def test_json_schema_output_parses_and_fits(client):
    reply = chat(
        client,
        "Is it ok? Give a number.",
        max_tokens=200,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "flags", "schema": FLAGS, "strict": True},
        },
    )
    assert reply.choices[0].finish_reason == "stop"
    value = json.loads(reply.choices[0].message.content)
    assert list(value) == ["ok", "n"] and isinstance(value["ok"], bool)
    assert isinstance(value["n"], int) and abs(value["n"]) < 2**63


def test_a_required_tool_call_in_the_family_format(served, client):
    family, _, server = served
    reply = chat(
        client,
        "What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # a random model, free to, calls again and again
        max_tokens=300,  # a random model's string may be escapes: 6 tokens a character
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    # the template itself rendered the tool: its description is in the counted prompt
    counted = httpx.post(
        f"{server.base_url}/tokenize",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": model_id(client),
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER],
        },
    )
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == reply.usage.prompt_tokens
