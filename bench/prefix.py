"""Prefix reuse: a chat that resends a long document every turn, as chat clients do.

A document of real text (bench/recall_corpus.py) with facts planted in it is sent inline with
a first question; each later turn resends the whole conversation (document, earlier questions
and answers) with the next question, through the openai SDK. One JSON line per turn: seconds,
prompt tokens, `usage.prompt_tokens_details.cached_tokens`, the answer and whether it holds the
planted value. Then, unless --no-verify, the same turns (the same messages, answers included)
go to a second server with the prefix caches off (LONGSERVE_PREFIX_CACHE_BYTES=0 for long
prompts, LONGSERVE_KV_PREFIX_CACHE_BYTES=0 for those that fit the window), and the last
line gives each turn's time relative to turn 1 and whether every answer matched.

With --replicas N, the chat goes to N servers in turn (turn t to replica t mod N), as behind a
proxy without affinity: each on one memory service over Redis, with the prefix cache's
write-through on (LONGSERVE_PREFIX_CACHE_STORE=1, engine/caches/prefix_store.py), so a turn on another
replica imports what the first one read.

    longserve bench prefix --length 32768 --turns 3 [--replicas 2]
    longserve bench prefix --length 6000 --turns 3     # fits the window: kept keys and values
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench.recall_corpus import build_document, load_token_counter
from bench.recall_tasks import is_correct, make_trial
from bench.server_process import model_args, served


def conversation(args: argparse.Namespace) -> tuple[str, list]:
    """The document (with the trial's facts planted) and one question per turn."""
    count = load_token_counter(args.model)
    trial = make_trial(args.seed, tasks=("multikey",), keys=args.turns)
    doc = build_document(trial, args.kind, str(args.seed), args.length, 4096, count)
    return doc.text, list(trial.questions[: args.turns])


def chat(bases: list[str], model: str, document: str, questions: list,
         answers: list[str] | None, max_tokens: int) -> list[dict]:  # fmt: skip
    """Ask the questions turn by turn, resending everything, turn t to bases[t mod N]; with
    `answers` (a verification run) the conversation carries those answers instead of the
    servers' own."""
    import openai

    clients = [
        openai.OpenAI(base_url=f"{base}/v1", api_key="bench", timeout=3600, max_retries=0)
        for base in bases
    ]
    messages: list[dict] = []
    out = []
    for turn, question in enumerate(questions):
        client = clients[turn % len(clients)]
        text = question.turns[0]
        messages.append({"role": "user", "content": f"{document}\n\n{text}" if turn == 0 else text})
        started = time.perf_counter()
        reply = client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=max_tokens
        )
        seconds = time.perf_counter() - started
        answer = reply.choices[0].message.content or ""
        usage = reply.usage
        details = usage.prompt_tokens_details if usage is not None else None
        out.append(
            {
                "turn": turn + 1,
                "replica": turn % len(clients),
                "seconds": round(seconds, 2),
                "prompt_tokens": usage.prompt_tokens if usage is not None else 0,
                "cached_tokens": details.cached_tokens if details is not None else 0,
                "answer": answer,
                "correct": is_correct(answer, question.expected),
            }
        )
        said = answer if answers is None else answers[turn]
        messages.append({"role": "assistant", "content": said})
    return out


def model_id(base: str) -> str:
    import httpx

    return httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]


@contextmanager
def replicas(args: argparse.Namespace) -> Iterator[list[str]]:
    """args.replicas servers on one memory service over one redis-server, writing through."""
    from bench.soak_processes import MemoryService, Redis

    with tempfile.TemporaryDirectory(prefix="longserve-prefix-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        (root / "redis").mkdir()
        redis = Redis(False, root / "redis")
        stack.callback(redis.stop)
        service = MemoryService(redis.url, root / "memory-store.log")
        service.start()
        stack.callback(service.kill)
        serve = ["--memory-store", service.url, *model_args(args)]
        env = {"LONGSERVE_PREFIX_CACHE_STORE": "1"}
        yield [
            stack.enter_context(served(None, serve_args=serve, env=env, ready_timeout=600))
            for _ in range(args.replicas)
        ]


def run(args: argparse.Namespace) -> None:
    document, questions = conversation(args)
    runs = {}
    settings = [("cache", {})]
    if not args.no_verify:
        settings.append(
            (
                "no_cache",
                {"LONGSERVE_PREFIX_CACHE_BYTES": "0", "LONGSERVE_KV_PREFIX_CACHE_BYTES": "0"},
            )
        )
    answers: list[str] | None = None
    for name, env in settings:
        if name == "cache" and args.replicas > 1:
            servers = replicas(args)
        else:
            base_url = args.base_url if name == "cache" else None
            servers = served(base_url, serve_args=model_args(args), env=env)
        with servers as bases:
            bases = bases if isinstance(bases, list) else [bases]
            turns = chat(bases, model_id(bases[0]), document, questions, answers, args.max_tokens)
        answers = [t["answer"] for t in turns]
        runs[name] = turns
        for turn in turns:
            print(json.dumps({"bench": "prefix", "server": name, **turn}), flush=True)
    cached = runs["cache"]
    first = cached[0]["seconds"]
    summary = {
        "bench": "prefix",
        "summary": True,
        "length": args.length,
        "replicas": args.replicas,
        "kind": args.kind,
        "turn_seconds": [t["seconds"] for t in cached],
        "vs_turn1": [round(t["seconds"] / first, 3) for t in cached],
        "cached_tokens": [t["cached_tokens"] for t in cached],
    }
    if "no_cache" in runs:
        plain = runs["no_cache"]
        summary["no_cache_turn_seconds"] = [t["seconds"] for t in plain]
        summary["same_answers"] = [
            a["answer"] == b["answer"] for a, b in zip(cached, plain, strict=True)
        ]
    print(json.dumps(summary), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="longserve bench prefix",
        description="A chat resending a long document each turn: time per turn with the prefix "
        "cache, and the same turns without it.",
    )
    parser.add_argument("--length", type=int, default=32768, help="document tokens")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--kind", default="docs", choices=("docs", "manpages", "docstrings"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-verify", action="store_true", help="skip the no-cache server")
    parser.add_argument("--base-url", help="a running server on loopback (with the cache)")
    parser.add_argument(
        "--replicas", type=int, default=1, help="N > 1: N servers sharing one memory store"
    )
    parser.add_argument("--model")
    parser.add_argument("--device")
    args = parser.parse_args(argv)
    if args.turns < 1:
        raise SystemExit("--turns must be at least 1")
    if args.replicas < 1 or (args.replicas > 1 and args.base_url):
        raise SystemExit("--replicas must be at least 1, and starts its own servers")
    run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
