"""Structured answers about a document longer than the window: JSON vs free text, one run.

Each trial is a document of real text (--kind) of --tokens tokens with facts planted at random
depths (bench/recall_tasks.py: the "single" and "multikey" tasks, 4 facts), uploaded to a
session. Every fact's question is asked twice in a new chat on that session: as free text, and
with a json_schema response_format asking for the value as {"value": <string>}. A free answer is
right when it contains the value; a JSON answer is valid when it parses and has the field,
right when the field contains the value. One JSON line per answer, then the totals with
Wilson 95 % intervals.

    longserve bench json_recall --tokens 16384 -n 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import httpx

from bench.recall import upload
from bench.recall_corpus import filler, load_token_counter
from bench.recall_tasks import is_correct, make_trial, plant_facts, wilson
from bench.server_process import model_args, served

SCHEMA = {
    "type": "object",
    "properties": {"value": {"type": "string", "maxLength": 40}},
    "required": ["value"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


def ask(http: httpx.Client, model: str, session: str, question: str, structured: bool) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 48,
        "session_id": session,
    }
    if structured:
        body["response_format"] = FORMAT
    reply = http.post("/chat/completions", json=body).json()
    return reply["choices"][0]["message"]["content"] or ""


def score(answer: str, expected: tuple[str, ...], structured: bool) -> dict:
    if not structured:
        return {"right": is_correct(answer, expected)}
    try:
        value = json.loads(answer)["value"]
    except (ValueError, KeyError, TypeError):
        return {"valid": False, "right": False}
    return {"valid": True, "right": is_correct(str(value), expected)}


def run(args: argparse.Namespace) -> None:
    counter = load_token_counter(args.model)
    lines = []
    started = time.perf_counter()
    headers = {"Authorization": f"Bearer {args.api_key}"}
    with served(args.base_url, serve_args=model_args(args), ready_timeout=300) as base:
        http = httpx.Client(base_url=f"{base}/v1", headers=headers, timeout=600)
        model = http.get("/models").json()["data"][0]["id"]
        for seed in range(args.n):
            trial = make_trial(f"json-{seed}", tasks=("single", "multikey"))
            paragraphs = [p for p, _ in filler(args.kind, f"json-{seed}", args.tokens, counter)]
            text = "\n\n".join(plant_facts(paragraphs, trial.facts))
            session, tokens, seconds = upload(http, {"strategy": args.strategy}, text, 3600)
            for question in trial.questions:
                for structured in (False, True):
                    answer = ask(http, model, session, question.turns[0], structured)
                    line = {
                        "bench": "json_recall",
                        "trial": seed,
                        "doc_tokens": tokens,
                        "task": question.task,
                        "structured": structured,
                        "answer": answer,
                        "expected": question.expected,
                        **score(answer, question.expected, structured),
                    }
                    print(json.dumps(line), flush=True)
                    lines.append(line)
            http.delete(f"/sessions/{session}")

    def total(rows: list[dict], key: str) -> dict:
        k, n = sum(bool(r.get(key)) for r in rows), len(rows)
        low, high = wilson(k, n)
        return {"k": k, "n": n, "wilson95": [round(low, 2), round(high, 2)]}

    free = [x for x in lines if not x["structured"]]
    structured = [x for x in lines if x["structured"]]
    print(
        json.dumps(
            {
                "bench": "json_recall",
                "tokens": args.tokens,
                "strategy": args.strategy,
                "free_right": total(free, "right"),
                "json_valid": total(structured, "valid"),
                "json_right": total(structured, "right"),
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("-n", type=int, default=2, help="trials (documents)")
    parser.add_argument("--kind", default="manpages", choices=["manpages", "docs", "docstrings"])
    parser.add_argument("--strategy", default="segments")
    parser.add_argument("--base-url", help="a running server on loopback (default: start one)")
    parser.add_argument("--api-key", default="bench")
    parser.add_argument("--model", help="--model of the started server (default: embedded)")
    parser.add_argument("--device", help="--device of the started server")
    args = parser.parse_args(argv)
    run(args)


if __name__ == "__main__":
    sys.exit(main())
