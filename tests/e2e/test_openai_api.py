"""The serving spine end to end: a real server process, the embedded model, the official SDK."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_until

from .conftest import API_KEY, start_server, stop_server

pytestmark = pytest.mark.real_model

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def metric_value(server, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(server.metrics()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_models_list_names_the_embedded_model_and_its_adapter(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct:recall"]
    assert models[0].object == "model"
    assert models[1].model_extra["parent"] == "SmolLM2-135M-Instruct"


def test_the_shipped_adapter_answers_as_its_model(client, model_id):
    """engine/adapters/recall.safetensors, named by model id, answers a plain chat."""
    reply = client.chat.completions.create(
        model=f"{model_id}:recall", messages=CAPITAL, temperature=0, max_tokens=24
    )
    assert reply.model == f"{model_id}:recall"
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0


def test_chat_answers_paris(client, model_id):
    reply = client.chat.completions.create(model=model_id, messages=CAPITAL, temperature=0)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert reply.usage.prompt_tokens > 5 and reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_ends_with_usage_chunk(client, model_id):
    stream = client.chat.completions.create(
        model=model_id,
        messages=CAPITAL,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_with_and_without_stream(client, model_id):
    prompt = "The capital of France is"
    reply = client.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0)
    assert reply.choices[0].text.strip() and reply.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model_id, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == reply.choices[0].text


def test_max_tokens_gives_length(client, model_id):
    reply = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=5,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5


def test_stop_string_is_cut_and_not_returned(client, model_id):
    reply = client.chat.completions.create(
        model=model_id, messages=CAPITAL, temperature=0, stop=["Paris"]
    )
    assert reply.choices[0].finish_reason == "stop"
    assert "Paris" not in reply.choices[0].message.content
    assert "France" in reply.choices[0].message.content


def test_same_seed_same_text(client, model_id):
    def sample(seed: int) -> str:
        return (
            client.chat.completions.create(
                model=model_id,
                messages=[{"role": "user", "content": "Name an animal."}],
                temperature=1.0,
                seed=seed,
                max_tokens=12,
            )
            .choices[0]
            .message.content
        )

    assert sample(7) == sample(7)


def test_n_choices(client, model_id):
    reply = client.chat.completions.create(
        model=model_id, messages=CAPITAL, temperature=0, n=2, max_tokens=8
    )
    assert [c.index for c in reply.choices] == [0, 1]


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=CAPITAL)
    assert info.value.body["code"] == "model_not_found"


def test_bad_key_is_rejected(server):
    bad = openai.OpenAI(base_url=server.api_base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


async def test_async_client_streams(server, model_id):
    client = openai.AsyncOpenAI(base_url=server.api_base, api_key=API_KEY, max_retries=0)
    stream = await client.chat.completions.create(
        model=model_id, messages=CAPITAL, temperature=0, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert "Paris" in text
    reply = await client.chat.completions.create(model=model_id, messages=CAPITAL, temperature=0)
    assert reply.choices[0].message.content == text
    await client.close()


def test_client_closing_a_stream_frees_the_request(server, client, model_id):
    stream = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Tell me a very long story."}],
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for index, _ in enumerate(stream):
        if index == 3:
            break
    assert metric_value(server, "longserve:num_requests_running") >= 0
    stream.close()
    wait_until(
        lambda: metric_value(server, "longserve:num_requests_running") == 0,
        "the closed stream is still running",
        timeout_s=10,
        interval_s=0.1,
    )


async def test_full_queue_answers_429_with_retry_after(tmp_path, model_id):
    small = start_server(tmp_path, "--max-running-requests", "1", "--max-waiting-requests", "1")
    try:
        body = {"model": model_id, "messages": CAPITAL, "max_tokens": 16, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=small.api_base, headers=headers, timeout=300) as http:
            replies = await asyncio.gather(
                *(http.post("/chat/completions", json=body) for _ in range(6))
            )
        statuses = sorted(r.status_code for r in replies)
        assert 200 in statuses and 429 in statuses, statuses
        assert all(s in (200, 429) for s in statuses), statuses
        limited = next(r for r in replies if r.status_code == 429)
        assert float(limited.headers["Retry-After"]) > 0
        assert limited.json()["error"]["type"]
    finally:
        stop_server(small)
