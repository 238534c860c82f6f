"""Memory under load: concurrent questions on sessions, and decoding while a long prompt is read.

Two workloads through the HTTP API and the async openai SDK, on one server started here (or a
running one on loopback, --base-url):

1. `sessions`: --sessions sessions, each holding its own document of real text (--doc-tokens,
   longer than the frame's local window, so decode steps retrieve from memory). For each
   concurrency N, N clients each ask their own session a question (a new chat each time),
   streaming exactly --max-tokens tokens, --requests-per-client times (after one warm-up
   question per session, whose first question embeds its blocks for the text prior). One JSON
   line per level
   (output tokens/s, TTFT, ITL as bench/load.py reports them), then each level's output
   throughput relative to N = 1. With --variants NAME=JSON, each variant's memory knobs get
   sessions of their own on the same documents and the levels run variant after variant on
   the same server, then each level's throughput and median ITL against the first variant's
   (a knob's cost in one run, e.g. `--variants plain='{}' cad='{"contrast": 0.5}'`).
2. `reading`: a streaming plain request's inter-token latency alone, then while another
   request sends a --read-tokens document inline (read through memory): ITL mean/median/p99,
   and the reader's own time, alone and with the stream beside it.

    longserve bench memory_load --concurrency 1 4 8 16 --read-tokens 32768
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx

from bench.load import RequestResult, stats_ms
from bench.load import one_request as stream
from bench.recall import upload
from bench.recall_corpus import filler, load_token_counter
from bench.server_process import add_server_arguments, model_args, served

QUESTIONS = [
    "What is this document about?",
    "Summarize the first part of the document.",
    "Which options or functions does the document describe?",
    "What does the document say about errors?",
]
STORY = "Write a long story about a lighthouse keeper and the ships she watched."


def documents(args: argparse.Namespace, count: int, tokens: int) -> list[str]:
    """count documents of real text, about `tokens` tokens each, none sharing a source order."""
    counter = load_token_counter(args.model)
    return [
        "\n\n".join(p for p, _ in filler(args.kind, f"load-{i}", tokens, counter))
        for i in range(count)
    ]


def summary(results: list[RequestResult], seconds: float, **fields) -> dict:
    done = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    tokens = sum(r.output_tokens for r in done)
    return {
        **fields,
        "completed": len(done),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "duration_s": round(seconds, 2),
        "output_token_throughput": round(tokens / seconds, 2) if seconds else None,
        **stats_ms("ttft", [r.ttft for r in done]),
        **stats_ms("itl", [gap for r in done for gap in r.itl]),
    }


async def sessions_level(client, model, session_ids, concurrency, args) -> dict:
    async def user(index: int) -> list[RequestResult]:
        out = []
        for turn in range(args.requests_per_client):
            question = QUESTIONS[(index + turn) % len(QUESTIONS)]
            messages = [{"role": "user", "content": question}]
            out.append(
                await stream(
                    client, model, messages, args.max_tokens, session_id=session_ids[index]
                )
            )
        return out

    started = time.perf_counter()
    per_user = await asyncio.gather(*(user(i) for i in range(concurrency)))
    seconds = time.perf_counter() - started
    results = [r for rs in per_user for r in rs]
    return summary(
        results, seconds, bench="memory_load", workload="sessions", concurrency=concurrency
    )


async def reading(client, model, document: str, args) -> list[dict]:
    """ITL of a streaming plain request alone, then beside a long prompt being read."""
    story = [{"role": "user", "content": STORY}]

    def long_prompt(name: str) -> list[dict]:  # another first chunk: nothing reused
        text = f"Document {name}.\n\n{document}\n\nWhat is this document about?"
        return [{"role": "user", "content": text}]

    lines = []
    started = time.perf_counter()
    alone = await stream(client, model, story, args.stream_tokens)
    lines.append(
        summary([alone], time.perf_counter() - started, workload="reading", case="stream alone")
    )

    started = time.perf_counter()
    reader = await stream(client, model, long_prompt("A"), 8)
    read_alone = time.perf_counter() - started
    lines.append(summary([reader], read_alone, workload="reading", case="read alone"))

    async def delayed_stream() -> RequestResult:
        await asyncio.sleep(args.stream_delay)  # the reader is under way
        return await stream(client, model, story, args.stream_tokens)

    started = time.perf_counter()
    reader_task = asyncio.create_task(stream(client, model, long_prompt("B"), 8))
    beside = await delayed_stream()
    beside_seconds = time.perf_counter() - started
    reader = await reader_task
    read_beside = time.perf_counter() - started
    lines.append(summary([beside], beside_seconds, workload="reading", case="stream while reading"))
    lines.append(summary([reader], read_beside, workload="reading", case="read beside a stream"))
    return [{"bench": "memory_load", "read_tokens": args.read_tokens, **line} for line in lines]


async def run(args: argparse.Namespace) -> None:
    import openai

    most = max(args.concurrency)
    running = str(max(most, 2) + 1)  # one API key: its share is every slot
    serve_args = [
        *("--max-running-requests", running, "--max-running-requests-per-tenant", running),
        *model_args(args),
    ]
    docs = documents(args, args.sessions, args.doc_tokens)
    long_doc = documents(args, 1, args.read_tokens)[0] if args.read_tokens else ""
    with served(args.base_url, serve_args=serve_args, ready_timeout=args.ready_timeout) as base:
        client = openai.AsyncOpenAI(
            base_url=f"{base}/v1", api_key=args.api_key, timeout=3600, max_retries=0
        )
        model = (await client.models.list()).data[0].id
        headers = {"Authorization": f"Bearer {args.api_key}"}
        http = httpx.Client(base_url=f"{base}/v1", headers=headers, timeout=600)
        if args.sessions:
            levels = {}
            for name, knobs in (args.variants or {"": {}}).items():
                knobs = {**args.knobs, **knobs}
                levels[name] = await sessions_levels(client, http, model, docs, knobs, args, name)
            if args.variants:
                print(json.dumps(against_first(levels)))
        if args.read_tokens:
            for line in await reading(client, model, long_doc, args):
                print(json.dumps(line), flush=True)
        await client.close()


async def sessions_levels(client, http, model, docs, knobs, args, variant: str) -> list[dict]:
    """The `sessions` workload on sessions of `knobs`: a line per concurrency level."""
    ids = []
    for text in docs:
        session_id, tokens, seconds = upload(http, {"strategy": args.strategy, **knobs}, text, 3600)
        ids.append(session_id)
    print(json.dumps({"bench": "memory_load", "sessions": len(ids), "doc_tokens": tokens,
                      "knobs": knobs, "variant": variant}))  # fmt: skip
    # every session answers once first: its first question embeds its blocks for the text
    # prior (a one-off per document, which would land in whichever level asks first)
    hello = [{"role": "user", "content": "Hi"}]
    await asyncio.gather(*(stream(client, model, hello, 4, session_id=i) for i in ids))
    lines = []
    for concurrency in args.concurrency:
        line = await sessions_level(client, model, ids, concurrency, args)
        line["variant"] = variant
        print(json.dumps(line), flush=True)
        lines.append(line)
    first = lines[0]["output_token_throughput"]
    ratios = {
        str(line["concurrency"]): round(line["output_token_throughput"] / first, 2)
        for line in lines
    }
    print(json.dumps({"bench": "memory_load", "workload": "sessions", "variant": variant,
                      "vs_first": ratios}))  # fmt: skip
    return lines


def against_first(levels: dict[str, list[dict]]) -> dict:
    """Each variant's throughput and median ITL at each level over the first variant's."""
    names = list(levels)
    base = {line["concurrency"]: line for line in levels[names[0]]}
    out: dict = {"bench": "memory_load", "workload": "sessions", "against": names[0]}
    for name in names[1:]:
        out[name] = {
            str(c): {
                "throughput": round(
                    line["output_token_throughput"] / base[c]["output_token_throughput"], 3
                ),
                "median_itl": round(line["median_itl_ms"] / base[c]["median_itl_ms"], 3),
            }  # fmt: skip
            for line in levels[name]
            if (c := line["concurrency"]) in base
        }
    return out


def _variant(text: str) -> tuple[str, dict]:
    name, sep, knobs = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=JSON, got {text!r}")
    return name, json.loads(knobs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--sessions", type=int, help="default: the highest concurrency")
    parser.add_argument("--doc-tokens", type=int, default=3072)
    parser.add_argument("--strategy", default="segments")
    parser.add_argument(
        "--knobs", type=json.loads, default={}, help="the sessions' memory knobs (JSON)"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        type=_variant,
        help="NAME=JSON memory knobs, each measured in turn on the same server (over --knobs)",
    )
    parser.add_argument("--kind", default="docs", choices=["manpages", "docs", "docstrings"])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--read-tokens", type=int, default=32768, help="0: skip `reading`")
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--stream-delay", type=float, default=5.0)
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    args.variants = dict(args.variants) if args.variants else None
    if args.sessions is None:
        args.sessions = max(args.concurrency)
    if args.sessions and args.sessions < max(args.concurrency):
        parser.error("--sessions must be at least the highest concurrency (or 0: skip)")
    asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
