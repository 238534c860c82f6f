"""/tokenize, /detokenize and /tokenizer_info in vLLM's shapes, against the fake engine (whose
words are its tokens)."""

from __future__ import annotations

import httpx

from server.settings import tenant_of
from tests.server.conftest import API_KEY, MODEL
from tests.server.fake_engine import FakeEngine

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


async def test_a_prompt_round_trips(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post("/tokenize", json={"model": MODEL, "prompt": "the quick fox"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == 4 and len(body["tokens"]) == 4  # <s> the quick fox
    assert body["max_model_len"] == 2048
    assert "token_strs" not in body
    assert engine.tokenized == [("the quick fox", tenant_of(API_KEY))]  # the tenant's share
    # lm-eval's remote tokenizer: no model, no special tokens; then back to text
    r = await client.post(
        "/tokenize", json={"prompt": "the quick fox", "add_special_tokens": False}
    )
    tokens = r.json()["tokens"]
    assert len(tokens) == 3
    r = await client.post("/detokenize", json={"tokens": tokens})
    assert r.status_code == 200 and r.json() == {"prompt": "the quick fox"}


async def test_token_strings_when_asked(client: httpx.AsyncClient) -> None:
    r = await client.post("/tokenize", json={"prompt": "a b", "return_token_strs": True})
    assert r.json()["token_strs"] == ["<s>", "a", "b"]


async def test_chat_counts_what_the_chat_prompt_holds(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    messages = [{"role": "user", "content": "weather in Paris"}]
    r = await client.post("/tokenize", json={"messages": messages})
    assert r.json()["count"] == 4  # three words and the generation prompt
    r = await client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert r.json()["count"] == 3
    # with tools: rendered into a system message as a chat request renders them
    r = await client.post("/tokenize", json={"messages": messages, "tools": [WEATHER]})
    assert r.json()["count"] > 4
    rendered = engine.tokenized[-1][0]
    assert rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    chat = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "tools": [WEATHER], "max_tokens": 2},
    )
    assert chat.json()["usage"]["prompt_tokens"] == len(
        (rendered[0]["content"] + " " + rendered[1]["content"]).split()
    )


async def test_bad_input_is_a_clean_400(client: httpx.AsyncClient) -> None:
    cases = [
        ({}, None),  # neither form
        ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, None),  # both
        ({"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
         "continue_final_message"),
        ({"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True},
         "add_special_tokens"),
        ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "x"}]}, None),
    ]  # fmt: skip
    for body, param in cases:
        r = await client.post("/tokenize", json=body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        if param:
            assert error["param"] == param
    r = await client.post("/tokenize", json={"model": "other", "prompt": "a"})
    assert r.status_code == 404
    await client.post("/tokenize", json={"prompt": "a"})
    r = await client.post("/detokenize", json={"tokens": [0, 10_000]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert "10000" in r.json()["error"]["message"]
    r = await client.post("/detokenize", json={"tokens": ["x"]})
    assert r.status_code == 400


async def test_a_key_is_required(client: httpx.AsyncClient) -> None:
    for method, path, body in [
        ("POST", "/tokenize", {"prompt": "a"}),
        ("POST", "/detokenize", {"tokens": [0]}),
        ("GET", "/tokenizer_info", None),
    ]:
        r = await client.request(method, path, json=body, headers={"authorization": "Bearer no"})
        assert r.status_code == 401, path


async def test_tokenizer_info(client: httpx.AsyncClient) -> None:
    r = await client.get("/tokenizer_info")
    assert r.status_code == 200
    assert r.json()["eos_token"] == "</s>"  # what lm-eval's remote tokenizer checks for


async def test_completions_take_token_id_prompts(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    """OpenAI's prompt forms: token ids, and lists of them (lm-eval sends these), counted and
    answered as the text they stand for."""
    ids = (await client.post("/tokenize", json={"prompt": "the quick fox"})).json()["tokens"]
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    other = (await client.post("/tokenize", json={"prompt": "lazy dog"})).json()["tokens"]
    body = {"model": MODEL, "prompt": [ids, other], "n": 2, "max_tokens": 2}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    assert r.json()["usage"]["prompt_tokens"] == len(ids) + len(other)


async def test_bad_token_id_prompts_are_a_clean_400(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    await client.post("/tokenize", json={"prompt": "a b"})
    for prompt in ([0, 99_999], [["a"], [1]], [1, [2]], []):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 400, (prompt, r.text)
        assert r.json()["error"]["param"] == "prompt"
    assert engine.calls == []
