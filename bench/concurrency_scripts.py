"""The requests of the concurrency-differential harness (bench/concurrency.py): one script per
path, each a few HTTP requests that depend on each other (a session's chats, a Responses
follow-up), run in order. Every script returns what a client would see and compare: greedy
text, tool calls, finish reason, usage, and a session's `turns` and `memory_tokens`."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

MEMORY_STRATEGIES = ("segments", "tokens", "neurocache", "larimar")
COLORS = ("black", "red", "green", "blue", "white", "amber")
WORDS = [
    "the",
    "of",
    "and",
    "a",
    "to",
    "in",
    "was",
    "it",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "that",
    "this",
    "city",
    "river",
    "old",
    "market",
    "bridge",
    "house",
    "year",
    "people",
    "long",
    "small",
    "north",
    "ferry",
    "harbour",
    "lamp",
    "keeper",
    "winter",
    "road",
    "mill",
    "stone",
    "field",
]
Observation = dict[str, Any]


@dataclass
class Client:
    """One tenant's HTTP client and the model it asks."""

    http: httpx.AsyncClient
    model: str
    max_tokens: int = 24


Script = Callable[[Client], Awaitable[list[Observation]]]


def document(seed: int, words: int) -> tuple[str, dict[str, str]]:
    """Filler prose of about `words` words with a vault code planted per color."""
    rng = random.Random(seed)
    paragraphs = [
        " ".join(rng.choice(WORDS) for _ in range(50)).capitalize() + "."
        for _ in range(max(words // 50, 1))
    ]
    codes = {}
    for color in COLORS[:4]:
        codes[color] = str(rng.randrange(1_000_000, 9_999_999))
        fact = f"The vault painted {color} opens with the number {codes[color]}."
        paragraphs.insert(rng.randrange(len(paragraphs) + 1), fact)
    return "\n\n".join(paragraphs), codes


def question(color: str) -> dict[str, str]:
    return {"role": "user", "content": f"Which number opens the vault painted {color}?"}


def seen(reply: dict[str, Any]) -> Observation:
    """What a client compares of a chat completion (or its streamed equivalent)."""
    choice = reply["choices"][0]
    message = choice.get("message") or {}
    usage = reply.get("usage") or {}
    return {
        "text": message.get("content"),
        "tool_calls": [
            (c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []
        ],
        "finish_reason": choice.get("finish_reason"),
        "usage": [usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")],
    }


async def post(client: Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.http.post(path, json=body)
    if response.status_code != 200:
        raise RuntimeError(f"POST {path}: {response.status_code} {response.text[:300]}")
    reply: dict[str, Any] = response.json()
    return reply


async def stream_chat(client: Client, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed chat completion gathered into the shape of a plain one."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, finish, usage = "", None, None
    async with client.http.stream("POST", "/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"stream: {response.status_code} {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
    return {"choices": [{"message": {"content": text}, "finish_reason": finish}], "usage": usage}


async def chat(client: Client, messages: list, stream: bool = False, **extra: Any) -> Observation:
    body = {
        "model": client.model,
        "messages": messages,
        "temperature": 0,
        "max_tokens": client.max_tokens,
        **extra,
    }
    return seen(
        await (stream_chat(client, body) if stream else post(client, "/chat/completions", body))
    )


# -- the scripts: one per path ------------------------------------------------------------------


def plain(seed: int, stream: bool) -> Script:
    async def run(client: Client) -> list[Observation]:
        city = ["Paris", "Lisbon", "Oslo", "Cairo"][seed % 4]
        ask = {"role": "user", "content": f"Write one sentence about {city}."}
        return [await chat(client, [ask], stream)]

    return run


def completion(seed: int) -> Script:
    async def run(client: Client) -> list[Observation]:
        body = {
            "model": client.model,
            "prompt": ["The old harbour was", "In winter the river", "The lamp keeper"][seed % 3],
            "temperature": 0,
            "max_tokens": client.max_tokens,
        }
        reply = await post(client, "/completions", body)
        usage = reply["usage"]
        return [{"text": reply["choices"][0]["text"], "usage": [usage["prompt_tokens"], usage["completion_tokens"]]}]  # fmt: skip

    return run


def json_schema(seed: int) -> Script:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
        },  # fmt: skip
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "place", "schema": schema, "strict": True},
    }

    async def run(client: Client) -> list[Observation]:
        ask = {
            "role": "user",
            "content": ["Name a city in Spain.", "Name a city in Japan."][seed % 2],
        }
        return [await chat(client, [ask], response_format=fmt, max_tokens=40)]

    return run


def tools(seed: int) -> Script:
    city = {"type": "string", "maxLength": 30}
    schema = {"type": "object", "properties": {"city": city}, "required": ["city"]}
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "A city's weather.",
            "parameters": schema,
        },
    }

    async def run(client: Client) -> list[Observation]:
        ask = {"role": "user", "content": f"What is the weather in {['Rome', 'Lima'][seed % 2]}?"}
        return [await chat(client, [ask], tools=[weather], tool_choice="required", max_tokens=40)]

    return run


def responses(seed: int) -> Script:
    async def run(client: Client) -> list[Observation]:
        name = ["Marta", "Jonas", "Ines"][seed % 3]
        first = await post(client, "/responses", {
            "model": client.model, "input": f"The lighthouse keeper this season is {name}. Say hello to her.",
            "temperature": 0, "max_output_tokens": client.max_tokens,
        })  # fmt: skip
        second = await post(client, "/responses", {
            "model": client.model, "input": "Who is the lighthouse keeper this season?",
            "previous_response_id": first["id"], "temperature": 0, "max_output_tokens": client.max_tokens,
        })  # fmt: skip
        return [{"text": _output_text(r), "usage": r["usage"]} for r in (first, second)]

    return run


def _output_text(response: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "")
        for item in response.get("output", [])
        for part in item.get("content") or []
    )


def inline(seed: int, strategy: str, words: int, stream: bool) -> Script:
    """A prompt longer than the window: read into a memory of its own."""

    async def run(client: Client) -> list[Observation]:
        text, _ = document(seed, words)
        color = COLORS[seed % 4]
        ask = {"role": "user", "content": f"{text}\n\n{question(color)['content']}"}
        return [await chat(client, [ask], stream, memory={"strategy": strategy})]

    return run


def session(seed: int, strategy: str, words: int, stream: bool) -> Script:
    """Upload, a new chat, its continuation, another new chat; then the session's counts."""

    async def run(client: Client) -> list[Observation]:
        text, _ = document(seed, words)
        created = await post(client, "/sessions", {"memory": {"strategy": strategy}})
        sid = created["id"]
        await post(client, f"/sessions/{sid}/documents", {"name": "doc.txt", "text": text})
        first, second = question(COLORS[seed % 4]), question(COLORS[(seed + 1) % 4])
        out = [await chat(client, [first], stream, session_id=sid)]
        answer = {"role": "assistant", "content": out[0]["text"]}
        follow = {"role": "user", "content": "Say that number again."}
        out.append(await chat(client, [first, answer, follow], stream, session_id=sid))
        out.append(await chat(client, [second], stream, session_id=sid))
        info = (await client.http.get(f"/sessions/{sid}")).json()
        out.append({"turns": info.get("turns"), "memory_tokens": info.get("memory_tokens")})
        await client.http.delete(f"/sessions/{sid}")
        return out

    return run


def scripts(copies: int, doc_words: int, inline_words: int) -> dict[str, Script]:
    """Every path, `copies` times with other content: name -> script."""
    out: dict[str, Script] = {}
    for c in range(copies):
        out[f"plain-{c}"] = plain(c, stream=False)
        out[f"plain-stream-{c}"] = plain(c + 1, stream=True)
        out[f"completion-{c}"] = completion(c)
        out[f"json_schema-{c}"] = json_schema(c)
        out[f"tools-{c}"] = tools(c)
        out[f"responses-{c}"] = responses(c)
        for i, strategy in enumerate(MEMORY_STRATEGIES):
            seed = 100 * c + i
            stream = (c + i) % 2 == 1
            out[f"inline-{strategy}-{c}"] = inline(seed, strategy, inline_words, stream)
            out[f"session-{strategy}-{c}"] = session(seed + 50, strategy, doc_words, not stream)
    return out


async def run_script(script: Script, client: Client, delay: float = 0.0) -> list[Observation]:
    await asyncio.sleep(delay)
    try:
        return await script(client)
    except Exception as e:  # a failure is an observation too: it must not depend on load
        return [{"error": f"{type(e).__name__}: {e}"[:300]}]
