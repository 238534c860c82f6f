"""Load: throughput and latency of `longserve serve` under N concurrent streaming clients.

Starts the server as a subprocess on a free loopback port (with --max-running-requests at least
the highest concurrency), or drives a running one on loopback (--base-url). For each concurrency
level, N clients of the async openai SDK send fixed chat prompts, each streaming exactly
--max-tokens tokens (`ignore_eos`), until --requests-per-client x N requests are done (or
--level-timeout passes). One JSON line per level, with what vLLM's benchmark_serving reports:
request and output-token throughput, TTFT, TPOT and ITL (mean, median, p99, in ms), errors.
A last line gives each level's output throughput relative to the first level.

    python -m bench.load --concurrency 1 4 16 --max-tokens 32

TTFT is the time to the first streamed text; TPOT is (latency - TTFT) / (tokens - 1) per
request; ITL is every gap between two streamed chunks (a chunk may carry more than one token
when a token completes no UTF-8 character). Loopback only: this is a benchmark, not a load
generator for someone else's server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from bench.server_process import add_server_arguments, model_args, served

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List some good habits for writing maintainable code.",
    "Describe the water cycle in a few sentences.",
]
MAX_CONCURRENCY = 256
MAX_REQUESTS_PER_LEVEL = 1024


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)


async def one_request(
    client, model: str, prompt: str | list[dict], max_tokens: int, **extra
) -> RequestResult:
    """One streaming chat request of exactly max_tokens tokens (ignore_eos): a prompt (one user
    message) or messages; extra goes to the request body (e.g. session_id)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    result = RequestResult()
    started = time.perf_counter()
    last = None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, **extra},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - started
                else:
                    result.itl.append(now - last)
                last = now
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
    except Exception as e:  # an error is a measurement too
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - started
    if last is None or result.output_tokens != max_tokens:
        result.error = f"expected {max_tokens} tokens, got {result.output_tokens}"
        return result
    result.ok = True
    return result


async def run_level(
    client, model: str, concurrency: int, num_requests: int, max_tokens: int, timeout: float
) -> dict:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(num_requests):
        queue.put_nowait(index)
    results: list[RequestResult] = []

    async def user() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            results.append(
                await one_request(client, model, PROMPTS[index % len(PROMPTS)], max_tokens)
            )

    started = time.perf_counter()
    users = [asyncio.create_task(user()) for _ in range(concurrency)]
    _, pending = await asyncio.wait(users, timeout=timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - started
    return summarize(results, concurrency, num_requests, max_tokens, duration)


def stats_ms(name: str, values: list[float]) -> dict[str, float | None]:
    array = np.asarray(values, dtype=float) * 1000.0
    if array.size == 0:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    return {
        f"mean_{name}_ms": round(float(array.mean()), 2),
        f"median_{name}_ms": round(float(np.median(array)), 2),
        f"p99_{name}_ms": round(float(np.percentile(array, 99)), 2),
    }


def summarize(
    results: list[RequestResult],
    concurrency: int,
    num_requests: int,
    max_tokens: int,
    duration: float,
) -> dict:
    done = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    errors += ["not finished before --level-timeout"] * (num_requests - len(results))
    output_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "bench": "load",
        "concurrency": concurrency,
        "requests": num_requests,
        "completed": len(done),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "max_tokens": max_tokens,
        "duration_s": round(duration, 3),
        "request_throughput": round(len(done) / duration, 4),
        "output_token_throughput": round(output_tokens / duration, 2),
        **stats_ms("ttft", [r.ttft for r in done]),
        **stats_ms("tpot", tpot),
        **stats_ms("itl", [gap for r in done for gap in r.itl]),
    }


def serve_args(args: argparse.Namespace) -> list[str]:
    """One API key drives the load: its shares are the whole queue (docs/decisions/060)."""
    most = max(args.concurrency)
    running, waiting = str(max(args.max_running_requests or 0, most)), str(max(64, most))
    return [
        *("--max-running-requests", running, "--max-running-requests-per-tenant", running),
        *("--max-waiting-requests", waiting, "--max-waiting-requests-per-tenant", waiting),
        *model_args(args),
    ]


async def run(args: argparse.Namespace) -> None:
    import openai

    serving = served(
        args.base_url,
        serve_args=serve_args(args),
        ready_timeout=args.ready_timeout,
        prefix="longserve-load-",
    )
    with serving as base:
        client = openai.AsyncOpenAI(
            base_url=f"{base}/v1",
            api_key=args.api_key,
            timeout=args.level_timeout,
            max_retries=0,
        )
        model = (await client.models.list()).data[0].id
        warmup = await one_request(client, model, PROMPTS[0], 4)
        if not warmup.ok:
            raise RuntimeError(f"warm-up request failed: {warmup.error}")
        lines = []
        for concurrency in args.concurrency:
            num_requests = min(MAX_REQUESTS_PER_LEVEL, concurrency * args.requests_per_client)
            line = await run_level(
                client, model, concurrency, num_requests, args.max_tokens, args.level_timeout
            )
            print(json.dumps(line), flush=True)
            lines.append(line)
        base_tps = lines[0]["output_token_throughput"]
        print(
            json.dumps(
                {
                    "bench": "load",
                    "output_throughput_ratio_vs_concurrency_" + str(lines[0]["concurrency"]): {
                        str(line["concurrency"]): round(
                            line["output_token_throughput"] / base_tps, 2
                        )
                        if base_tps
                        else None
                        for line in lines
                    },
                }
            ),
            flush=True,
        )
        await client.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument(
        "--level-timeout", type=float, default=300.0, help="seconds one concurrency level may take"
    )
    add_server_arguments(parser)
    parser.add_argument(
        "--max-running-requests",
        type=int,
        help="of the started server (default: the highest concurrency)",
    )
    args = parser.parse_args(argv)
    if not all(1 <= c <= MAX_CONCURRENCY for c in args.concurrency):
        parser.error(f"concurrency levels must be in [1, {MAX_CONCURRENCY}]")
    if args.max_tokens < 2 or args.requests_per_client < 1:
        parser.error("--max-tokens must be >= 2 and --requests-per-client >= 1")
    asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
