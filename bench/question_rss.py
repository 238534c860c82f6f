"""The server's anonymous memory while one session is asked question after question: RssAnon
(from /proc) when idle, after the document is read, and after each chat question, greedy. A
server that keeps each answer's state (decision 084 found a reference cycle holding ~80 MB of
KV cache per answer) rises by that much a question; one that gives it back stays flat.

    longserve bench question_rss --questions 40 --chars 60000

Prints one JSON line per reading, then a summary: RssAnon after reading and after the last
question, the highest, and the rise per question (a least-squares slope over the questions).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import httpx

from bench.disk_tier import server_pid, status_kb
from bench.recall_chat import upload
from bench.recall_corpus import kind_paragraphs
from bench.server_process import add_server_arguments, model_args, served

TOPICS = ("harbour", "council", "river", "budget", "school", "festival", "bridge", "election")


def document(kind: str, chars: int, seed: int) -> str:
    """At least `chars` characters of one kind's paragraphs (bench.recall_corpus)."""
    parts: list[str] = []
    total = 0
    for paragraph in kind_paragraphs(kind, seed):
        parts.append(paragraph)
        total += len(paragraph) + 2
        if total > chars:
            break
    return "\n\n".join(parts)


def slope(values: Sequence[float]) -> float:
    """Least-squares rise per step of values (0 for fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
    return num / sum((x - mean_x) ** 2 for x in range(n))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--chars", type=int, default=60_000, help="the document's length")
    parser.add_argument("--kind", default="news", help="bench.recall_corpus's kind of text")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--serve-arg", action="append", default=[], help="more serve arguments")
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    text = document(args.kind, args.chars, 7)
    with served(args.base_url, serve_args=[*model_args(args), *args.serve_arg]) as base:
        pid = server_pid(base)

        def reading(**fields) -> float:
            rss = status_kb(pid)["RssAnon"] / 1e9
            print(json.dumps({**fields, "rss_anon_gb": round(rss, 3)}), flush=True)
            return rss

        headers = {"Authorization": f"Bearer {args.api_key}"}
        http = httpx.Client(base_url=base + "/v1", timeout=600, headers=headers)
        reading(at="idle")
        session, tokens, seconds = upload(http, {"strategy": "segments"}, text, 1800)
        read = reading(at="read", tokens=tokens, seconds=round(seconds, 1))
        model = http.get("/models").json()["data"][0]["id"]
        after = []
        for i in range(args.questions):
            question = f"What does the text say about the {TOPICS[i % len(TOPICS)]}?"
            body = {
                "model": model,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "session_id": session,
            }
            http.post("/chat/completions", json=body).raise_for_status()
            after.append(reading(at="question", n=i + 1))
    summary = {
        "tokens": tokens,
        "questions": len(after),
        "rss_anon_read_gb": round(read, 3),
        "rss_anon_last_gb": round(after[-1], 3) if after else None,
        "rss_anon_max_gb": round(max(after, default=read), 3),
        "rise_per_question_mb": round(slope(after) * 1000, 1),
    }
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    main()
