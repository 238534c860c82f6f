"""What the HTTP server adds: TTFT and decode tokens/s through `longserve serve` vs in process.

Same model, same prompt, greedy, the same number of tokens (ignore_eos), alternating the two
paths round by round so drift on a noisy machine hits both. One JSON line per path, then the
ratios:

    python -m bench.serving_overhead --rounds 5 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from bench.server_process import model_args, served
from engine.client import LocalEngine
from engine.config import EngineConfig
from engine.protocol import SamplingParams

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


async def in_process(engine: LocalEngine, max_tokens: int, index: int) -> tuple[float, float]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    first = None
    tokens = 0
    async for delta in engine.generate(f"bench-{index}", PROMPT, sampling):
        if first is None and delta.token_ids:
            first = time.perf_counter()
        tokens = delta.completion_tokens
    end = time.perf_counter()
    assert first is not None and tokens == max_tokens, tokens
    return first - started, (tokens - 1) / (end - first)


async def over_http(client, model: str, max_tokens: int) -> tuple[float, float]:
    started = time.perf_counter()
    first = None
    usage = None
    stream = await client.chat.completions.create(
        model=model,
        messages=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    assert first is not None and usage is not None and usage.completion_tokens == max_tokens
    return first - started, (usage.completion_tokens - 1) / (end - first)


async def run(args: argparse.Namespace) -> None:
    import openai

    engine = LocalEngine(EngineConfig(model=args.model, linear_dtype=args.linear_dtype))
    serve_args = [*model_args(args), "--linear-dtype", args.linear_dtype]
    with served(None, serve_args=serve_args, ready_timeout=180.0) as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="bench")
        model = (await client.models.list()).data[0].id
        # One warm-up each.
        await in_process(engine, 4, -1)
        await over_http(client, model, 4)
        results: dict[str, list[tuple[float, float]]] = {"in_process": [], "http": []}
        for index in range(args.rounds):
            results["in_process"].append(await in_process(engine, args.max_tokens, index))
            results["http"].append(await over_http(client, model, args.max_tokens))
        summary = {}
        for path, runs in results.items():
            ttft = statistics.median(r[0] for r in runs)
            tps = statistics.median(r[1] for r in runs)
            summary[path] = (ttft, tps)
            print(
                json.dumps(
                    {
                        "bench": "serving_overhead",
                        "path": path,
                        "rounds": args.rounds,
                        "max_tokens": args.max_tokens,
                        "ttft_ms_median": round(1000 * ttft, 1),
                        "decode_tokens_per_s_median": round(tps, 2),
                    }
                ),
                flush=True,
            )
        print(
            json.dumps(
                {
                    "bench": "serving_overhead",
                    "path": "ratio_http_vs_in_process",
                    "ttft_ratio": round(summary["http"][0] / summary["in_process"][0], 3),
                    "decode_throughput_ratio": round(
                        summary["http"][1] / summary["in_process"][1], 3
                    ),
                }
            ),
            flush=True,
        )
        await engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--linear-dtype", default="auto", help="auto, bfloat16 or int4")
    asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
