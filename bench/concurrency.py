"""Concurrency-differential harness: a request's greedy answer must not depend on other requests.

Every path's scripts (bench/concurrency_scripts.py: plain chat streamed and not, completions,
json_schema, tools, Responses with previous_response_id, long prompts through each memory
strategy, sessions with new and continued chats) run one at a time, then all at once in random
interleavings, each round as a tenant of its own (its own API key: no prefix cache or session
is shared between rounds). Greedy text, tool calls, finish reasons, usage and the sessions'
`turns` and `memory_tokens` must match the one-at-a-time run.

    longserve bench concurrency --copies 3 --rounds 3 --clients 8

Prints one JSON line per round (its mismatches) and a summary: mismatched scripts / scripts,
split into plain and memory paths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import httpx

from bench.concurrency_scripts import Client, Observation, Script, run_script, scripts
from bench.server_process import model_args, served

MEMORY_PATHS = ("inline-", "session-")


def api_keys(rounds: int) -> list[str]:
    """One key (tenant) for the one-at-a-time run, one per concurrent round."""
    return [f"concurrency-{i}" for i in range(rounds + 1)]


def client_for(base: str, key: str, model: str, max_tokens: int) -> Client:
    http = httpx.AsyncClient(
        base_url=f"{base}/v1", headers={"Authorization": f"Bearer {key}"}, timeout=900
    )
    return Client(http, model, max_tokens)


async def one_at_a_time(client: Client, plan: dict[str, Script]) -> dict[str, list[Observation]]:
    return {name: await run_script(script, client) for name, script in plan.items()}


async def all_at_once(
    client: Client, plan: dict[str, Script], clients: int, seed: int, jitter_s: float
) -> dict[str, list[Observation]]:
    """Every script at once, started in a shuffled order with random delays, at most `clients`
    running together."""
    rng = random.Random(seed)
    names = list(plan)
    rng.shuffle(names)
    gate = asyncio.Semaphore(clients)

    async def one(name: str, delay: float) -> tuple[str, list[Observation]]:
        async with gate:
            return name, await run_script(plan[name], client, delay)

    done = await asyncio.gather(*(one(n, rng.uniform(0, jitter_s)) for n in names))
    return dict(done)


def mismatches(
    alone: dict[str, list[Observation]], together: dict[str, list[Observation]]
) -> dict[str, dict[str, Any]]:
    """name -> {"alone": ..., "together": ...} for every script whose observations differ."""
    return {
        name: {"alone": alone[name], "together": together.get(name)}
        for name in alone
        if together.get(name) != alone[name]
    }


def failures(observations: dict[str, list[Observation]]) -> dict[str, str]:
    return {n: o["error"] for n, obs in observations.items() for o in obs if "error" in o}


def is_memory(name: str) -> bool:
    return name.startswith(MEMORY_PATHS)


async def harness(base: str, args: argparse.Namespace) -> dict[str, Any]:
    """The one-at-a-time run, then `rounds` concurrent rounds; a summary of what differed."""
    keys = api_keys(args.rounds)
    client = client_for(base, keys[0], "", args.max_tokens)
    model = client.model = (await client.http.get("/models")).json()["data"][0]["id"]
    plan = scripts(args.copies, args.doc_words, args.inline_words)
    started = time.perf_counter()
    alone = await one_at_a_time(client, plan)
    await client.http.aclose()
    alone_s = time.perf_counter() - started
    rounds = []
    for r in range(args.rounds):
        client = client_for(base, keys[r + 1], model, args.max_tokens)
        started = time.perf_counter()
        together = await all_at_once(client, plan, args.clients, args.seed + r, args.jitter)
        await client.http.aclose()
        differ = mismatches(alone, together)
        line = {
            "bench": "concurrency",
            "round": r,
            "seconds": round(time.perf_counter() - started, 1),
            "scripts": len(plan),
            "mismatched": sorted(differ),
            "errors": failures(together),
            "detail": differ,
        }
        print(json.dumps(line), flush=True)
        rounds.append(line)
    names = [n for line in rounds for n in line["mismatched"]]
    total = {"memory": sum(map(is_memory, plan)), "plain": sum(not is_memory(n) for n in plan)}
    return {
        "bench": "concurrency",
        "summary": True,
        "rounds": args.rounds,
        "clients": args.clients,
        "alone_seconds": round(alone_s, 1),
        "alone_errors": failures(alone),
        "memory_mismatched": f"{sum(map(is_memory, names))}/{total['memory'] * args.rounds}",
        "plain_mismatched": f"{sum(not is_memory(n) for n in names)}/{total['plain'] * args.rounds}",
        "alone": alone,
    }


def serve_args(args: argparse.Namespace) -> list[str]:
    out = ["--max-model-len", str(args.max_model_len), *model_args(args)]
    running = str(max(args.clients, 2))  # one API key per round: its share is every slot
    out += ["--max-running-requests", running, "--max-running-requests-per-tenant", running]
    for key in api_keys(args.rounds):
        out += ["--api-key", key]
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=3, help="each path this many times")
    p.add_argument("--rounds", type=int, default=3, help="concurrent rounds (interleavings)")
    p.add_argument("--clients", type=int, default=8, help="scripts running at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jitter", type=float, default=2.0, help="random start delays, seconds")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--doc-words", type=int, default=500, help="a session's document")
    p.add_argument("--inline-words", type=int, default=900, help="a long prompt's document")
    p.add_argument("--max-model-len", type=int, default=1024, help="the server's window")
    p.add_argument("--base-url", help="a running server (loopback) started with the same keys")
    p.add_argument("--model")
    p.add_argument("--device")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    return p


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with served(
        args.base_url, serve_args=serve_args(args), ready_timeout=args.ready_timeout
    ) as base:
        return await harness(base, args)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    summary = asyncio.run(run(args))
    summary.pop("alone")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
