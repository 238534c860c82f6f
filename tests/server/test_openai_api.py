"""The API as the official openai SDK sees it, against the fake engine."""

from __future__ import annotations

import openai
import pytest

from server.auth import tenant_session_id
from server.settings import tenant_of
from tests.server.conftest import API_KEY, MODEL
from tests.server.fake_engine import FakeEngine

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "the quick brown fox"},
]


async def test_models_list_and_retrieve(oai: openai.AsyncOpenAI) -> None:
    models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL, f"{MODEL}:recall"]
    adapter = await oai.models.retrieve(f"{MODEL}:recall")
    assert adapter.model_extra["parent"] == MODEL
    assert models.data[0].model_extra["parent"] is None
    model = await oai.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        await oai.models.retrieve("nope")


async def test_chat_completion(oai: openai.AsyncOpenAI, engine: FakeEngine) -> None:
    out = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    assert out.object == "chat.completion"
    assert out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "the quick brown fox"
    assert choice.finish_reason == "stop"
    assert out.usage is not None
    assert out.usage.prompt_tokens == 6
    assert out.usage.completion_tokens == 4
    assert out.usage.total_tokens == 10
    call = engine.calls[0]
    assert call.prompt == MESSAGES
    assert call.sampling.temperature == 0


async def test_chat_max_tokens_gives_length(oai: openai.AsyncOpenAI) -> None:
    out = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0
    )
    assert out.choices[0].message.content == "the quick"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 2


async def test_chat_stop_string(oai: openai.AsyncOpenAI, engine: FakeEngine) -> None:
    out = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, stop=" brown", temperature=0
    )
    assert out.choices[0].message.content == "the quick"
    assert out.choices[0].finish_reason == "stop"
    assert engine.calls[0].sampling.stop == (" brown",)


async def test_chat_stream_with_usage(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "the quick brown fox"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and finishes.count("stop") == 1
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (6, 4)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


async def test_chat_stream_without_usage(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, temperature=0
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)


async def test_chat_n2_fans_out_with_seeds(oai: openai.AsyncOpenAI, engine: FakeEngine) -> None:
    out = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, seed=7, max_tokens=5
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].message.content != out.choices[1].message.content
    ids = sorted(c.request_id for c in engine.calls)
    assert ids == [f"{out.id}-0", f"{out.id}-1"]
    assert sorted(c.sampling.seed for c in engine.calls) == [7, 8]
    assert out.usage is not None
    assert out.usage.completion_tokens == 10
    assert out.usage.prompt_tokens == 6  # counted once, not per choice
    again = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, seed=7, max_tokens=5
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]


async def test_chat_n2_stream(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, seed=1, max_tokens=3, stream=True
    )
    texts = {0: "", 1: ""}
    finishes = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"}
    assert all(len(t.split()) == 3 for t in texts.values())


async def test_chat_logprobs_shape(oai: openai.AsyncOpenAI) -> None:
    out = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, logprobs=True, top_logprobs=3
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [lp.token for lp in logprobs.content] == ["the", "quick", "brown", "fox"]
    first = logprobs.content[0]
    assert first.logprob == -0.25
    assert first.bytes == list(b"the")
    assert len(first.top_logprobs) == 3
    assert first.top_logprobs[0].token == "the"


async def test_chat_logprobs_stream(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, logprobs=True, top_logprobs=1, stream=True
    )
    tokens = [
        lp.token
        async for c in stream
        for ch in c.choices
        if ch.logprobs and ch.logprobs.content
        for lp in ch.logprobs.content
    ]
    assert tokens == ["the", "quick", "brown", "fox"]


async def test_chat_without_logprobs_has_none(oai: openai.AsyncOpenAI) -> None:
    out = await oai.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert out.choices[0].logprobs is None


async def test_completion(oai: openai.AsyncOpenAI, engine: FakeEngine) -> None:
    out = await oai.completions.create(model=MODEL, prompt="one two three", temperature=0)
    assert out.object == "text_completion"
    assert out.choices[0].text == "one two three"
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.prompt_tokens == 3
    assert engine.calls[0].prompt == "one two three"
    assert engine.calls[0].sampling.max_tokens == 16  # OpenAI's default for completions


async def test_completion_echo_puts_each_prompt_before_its_choices(
    oai: openai.AsyncOpenAI, engine: FakeEngine
) -> None:
    out = await oai.completions.create(
        model=MODEL, prompt=["a b", "c d e"], temperature=0, n=2, echo=True
    )
    assert [c.text for c in out.choices] == ["a ba b", "a ba b", "c d ec d e", "c d ec d e"]
    ids = (await engine.tokenize("c d", add_special_tokens=False)).ids  # a token prompt
    out = await oai.completions.create(model=MODEL, prompt=ids, temperature=0, echo=True)
    assert out.choices[0].text.startswith("c d")
    stream = await oai.completions.create(
        model=MODEL, prompt="one two", temperature=0, stream=True, echo=True
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].text == "one two"  # the prompt first
    assert "".join(c.choices[0].text for c in chunks) == "one twoone two"


async def test_completion_list_of_prompts(oai: openai.AsyncOpenAI) -> None:
    out = await oai.completions.create(model=MODEL, prompt=["a b", "c d e"], temperature=0, n=2)
    assert [c.text for c in out.choices] == ["a b", "a b", "c d e", "c d e"]
    assert out.usage is not None
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 10


async def test_completion_stream_with_usage(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.completions.create(
        model=MODEL,
        prompt="one two three",
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "one two three"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


async def test_completion_logprobs_legacy_shape(oai: openai.AsyncOpenAI) -> None:
    out = await oai.completions.create(model=MODEL, prompt="one two", temperature=0, logprobs=2)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["one", "two"]
    assert logprobs.token_logprobs == [-0.25, -0.25]
    assert logprobs.top_logprobs is not None
    assert logprobs.top_logprobs[0] == {"one": -0.25, "alt0": -2.0}
    assert logprobs.text_offset == [0, 3]


async def test_extension_fields_reach_the_engine(
    oai: openai.AsyncOpenAI, engine: FakeEngine
) -> None:
    await engine.create_session(tenant_session_id(tenant_of(API_KEY), "doc1"))
    await oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        extra_body={
            "session_id": "doc1",
            "memory": {"strategy": "tokens", "k": 32},
            "top_k": 5,
            "ignore_eos": True,
        },
    )
    call = engine.calls[0]
    # Sessions are scoped by tenant.
    assert call.session_id == tenant_session_id(tenant_of(API_KEY), "doc1")
    assert call.memory is not None
    assert call.memory.strategy == "tokens" and dict(call.memory.params) == {"k": 32}
    assert call.sampling.top_k == 5 and call.sampling.ignore_eos


async def test_unknown_session_is_404(oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        await oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"session_id": "missing"}
        )


async def test_an_adapter_model_answers_through_its_adapter(
    oai: openai.AsyncOpenAI, engine: FakeEngine
) -> None:
    """Naming an adapter's model id (vLLM's LoRA convention) runs the request with it, on
    chat, completions and responses alike; the answer names the model asked for."""
    name = f"{MODEL}:recall"
    chat = await oai.chat.completions.create(model=name, messages=MESSAGES, temperature=0)
    done = await oai.completions.create(model=name, prompt="the quick", max_tokens=4)
    reply = await oai.responses.create(model=name, input="the quick brown fox")
    plain = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    assert chat.model == done.model == reply.model == name and plain.model == MODEL
    assert [c.adapter for c in engine.calls] == [name, name, name, None]
    with pytest.raises(openai.NotFoundError):
        await oai.chat.completions.create(model=f"{MODEL}:other", messages=MESSAGES)


async def test_unknown_model_is_not_found(oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await oai.chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert info.value.code == "model_not_found"


async def test_bad_key_is_authentication_error(oai: openai.AsyncOpenAI) -> None:
    bad = oai.with_options(api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError) as info:
        await bad.models.list()
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"


async def test_validation_error_is_bad_request(oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=3)
    assert info.value.param == "temperature"


async def test_overloaded_is_rate_limit(oai: openai.AsyncOpenAI, engine: FakeEngine) -> None:
    engine.overloaded = True
    with pytest.raises(openai.RateLimitError) as info:
        await oai.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert info.value.response.headers["retry-after"] == "3"


async def test_usage_reports_cached_tokens_and_the_engine_gets_the_tenant(
    oai: openai.AsyncOpenAI, engine: FakeEngine
) -> None:
    out = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    engine.cached_tokens = 4  # a long prompt that started from a reused prefix
    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) == (6, 4)
    assert {call.tenant for call in engine.calls} == {tenant_of(API_KEY)}
