"""Constrained vs free decoding: tokens/s with and without a response_format, in one run.

Through the HTTP API and the async openai SDK, one streaming request at a time on one server
started here (or a running one on loopback, --base-url). For each prompt, a free request
(exactly --max-tokens tokens) and a json_schema request (up to --max-tokens, ending where the
JSON closes) alternate, so both see the same machine. Decode tokens/s of a request: its
tokens after the first over the time after the first. One JSON line per request, then the
median decode tokens/s of each, their ratio (target: constrained >= 0.9x free), how many
constrained answers parsed as JSON matching the schema's required keys, and how many were cut
by --max-tokens (finish_reason "length", the only way a constrained answer is not valid).

With --session-tokens N the requests run on a session holding N tokens of installed
documentation (read through memory, then each request a new chat after it), so both kinds
decode on the memory path.

    longserve bench structured --rounds 3
    longserve bench structured --rounds 3 --session-tokens 4096
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from bench.server_process import model_args, served

PROMPTS = [
    "Describe a fictional city: its name, country, population and three landmarks.",
    "Invent a book: title, author, year and its main characters.",
    "Describe a ship: its name, home port, length in metres and its crew.",
    "Describe a person: name, age, job and hobbies.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "place": {"type": "string", "maxLength": 60},
        "number": {"type": "integer"},
        "items": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 6},
    },
    "required": ["name", "place", "number", "items"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


async def one(
    client, model: str, prompt: str, max_tokens: int, constrained: bool, session: str | None
) -> dict:
    extra = {} if constrained else {"ignore_eos": True}
    if session is not None:
        extra["session_id"] = session
    fmt = {"response_format": FORMAT} if constrained else {}
    started = time.perf_counter()
    first = last = None
    text, tokens, finish = [], 0, None
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
        **fmt,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    decode = (last - first) if first is not None and last is not None else 0.0
    line = {
        "constrained": constrained,
        "tokens": tokens,
        "finish_reason": finish,
        "ttft_s": round((first or started) - started, 3),
        "decode_tok_s": round((tokens - 1) / decode, 2) if decode > 0 else None,
    }
    if constrained:
        try:
            value = json.loads("".join(text))
            line["valid"] = isinstance(value, dict) and set(SCHEMA["required"]) <= set(value)
        except ValueError:
            line["valid"] = False
    return line


async def run(args: argparse.Namespace) -> None:
    import openai

    with served(args.base_url, serve_args=model_args(args), ready_timeout=300) as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=args.api_key, max_retries=0)
        model = (await client.models.list()).data[0].id
        session = None
        if args.session_tokens:
            session = await asyncio.to_thread(session_with_document, base, args)
        await one(client, model, PROMPTS[0], 8, True, session)  # warm-up: both paths once
        await one(client, model, PROMPTS[0], 8, False, session)
        lines = []
        for _ in range(args.rounds):
            for prompt in PROMPTS:
                for constrained in (False, True):
                    line = await one(client, model, prompt, args.max_tokens, constrained, session)
                    print(json.dumps({"bench": "structured", **line}), flush=True)
                    lines.append(line)
        await client.close()

    def median(constrained: bool) -> float:
        rates = [x["decode_tok_s"] for x in lines if x["constrained"] == constrained]
        return statistics.median(r for r in rates if r)

    free, constrained = median(False), median(True)
    valid = [x["valid"] for x in lines if x["constrained"]]
    cut = sum(1 for x in lines if x["constrained"] and x["finish_reason"] == "length")
    summary = {
        "bench": "structured",
        "path": f"session ({args.session_tokens} tokens)" if args.session_tokens else "plain",
        "n": len(valid),
        "free_decode_tok_s": free,
        "constrained_decode_tok_s": constrained,
        "ratio": round(constrained / free, 3),
        "constrained_valid": f"{sum(valid)}/{len(valid)}",
        "constrained_cut_by_max_tokens": cut,  # finish_reason "length": the JSON is unfinished
    }
    print(json.dumps(summary))


def session_with_document(base: str, args: argparse.Namespace) -> str:
    """A session holding about --session-tokens tokens of installed documentation, read."""
    import httpx

    from bench.recall import upload
    from bench.recall_corpus import filler, load_token_counter

    counter = load_token_counter(args.model)
    text = "\n\n".join(p for p, _ in filler("manpages", "structured", args.session_tokens, counter))
    headers = {"Authorization": f"Bearer {args.api_key}"}
    with httpx.Client(base_url=f"{base}/v1", headers=headers, timeout=600) as http:
        session_id, tokens, _ = upload(http, {"strategy": "segments"}, text, timeout=1800)
    print(json.dumps({"bench": "structured", "session_tokens": tokens}), flush=True)
    return session_id


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--base-url", help="a running server on loopback (default: start one)")
    parser.add_argument("--api-key", default="bench")
    parser.add_argument("--model", help="--model of the started server (default: embedded)")
    parser.add_argument("--device", help="--device of the started server")
    parser.add_argument(
        "--session-tokens", type=int, default=0, help="run on a session holding this many tokens"
    )
    args = parser.parse_args(argv)
    asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
