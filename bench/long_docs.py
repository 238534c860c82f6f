"""Time to first token and decode speed for one chat about a document far past the window.

Each cell asks, through the HTTP API by streaming chat, one question about a document of
--lengths tokens sent inline (a long prompt the server answers through memory, as a user of
the openai SDK sends it), with --strategies: the passkey document of bench/passkey.py (filler
with a 5-digit key planted at a random depth), so every figure comes with whether the answer
was right (`--api completions` asks in bench/passkey.py's own format, the prompt continued
rather than a chat turn). Exactly --max-tokens new tokens (ignore_eos).

TTFT includes reading the whole document; prefill tokens/s is prompt tokens over TTFT; decode
tokens/s is the new tokens after the first over the time after it. Each cell's key and
filler differ, so no cell reuses another's prefix. One JSON line per cell:

    longserve bench long_docs --lengths 8192 131072 --strategies segments tokens neurocache
    longserve bench long_docs --device cuda --lengths 8192 131072 1048576 --strategies segments
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable

import httpx

from bench.passkey import FILLER, INTRO, QUESTION, first_number
from bench.server_process import served


def document(tokens_per_filler: float, n_tokens: int, key: str, depth: float, salt: int) -> str:
    """The passkey prompt's text at about n_tokens, opened by `salt` so that no two cells
    share a prefix the server could reuse."""
    needle = f" The pass key is {key}. Remember it. {key} is the pass key."
    repeats = max(1, int(n_tokens / tokens_per_filler))
    before = int(round(repeats * depth))
    return f"Document {salt}. " + INTRO + FILLER * before + needle + FILLER * (repeats - before)


def ask(
    http: httpx.Client,
    model: str,
    text: str,
    strategy: str,
    max_tokens: int,
    api: str,
    session: str | None = None,
    on_first: Callable[[], None] | None = None,
) -> dict:
    """text and the passkey question, streamed; on `session` (its memory already holds the
    document) instead of a memory of its own when given. on_first: called as the first token
    arrives (what the decode that follows costs is measured from there)."""
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "memory": {"strategy": strategy},
    }
    if session is not None:
        body["session_id"] = session
        del body["memory"]
    if api == "chat":
        body["messages"] = [{"role": "user", "content": text + QUESTION}]
    else:
        body["prompt"] = text + QUESTION
    started = time.perf_counter()
    stamps, pieces, usage = [], [], {}
    path = "/chat/completions" if api == "chat" else "/completions"
    with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or choice.get("text")
                if piece:
                    stamps.append(time.perf_counter())
                    pieces.append(piece)
                    if on_first is not None and len(stamps) == 1:
                        on_first()
    if not stamps:
        raise RuntimeError("no tokens came back")
    ttft = stamps[0] - started
    decode = stamps[-1] - stamps[0]
    prompt_tokens = usage.get("prompt_tokens")
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": usage.get("completion_tokens"),
        "ttft_s": round(ttft, 3),
        "prefill_tok_s": round(prompt_tokens / ttft, 1) if prompt_tokens else None,
        "decode_tok_s": round((len(stamps) - 1) / decode, 2) if decode > 0 else None,
        "answer": "".join(pieces)[:80],
    }


def run(args: argparse.Namespace) -> None:
    serve_args = ["--device", args.device] + (["--model", args.model] if args.model else [])
    rng = random.Random(args.seed)
    with served(None, serve_args=serve_args, ready_timeout=600) as base:
        http = httpx.Client(base_url=f"{base}/v1", timeout=args.timeout)
        model = http.get("/models").json()["data"][0]["id"]
        per_filler = tokens_per_filler(http, model)
        ask(http, model, "Hello.", args.strategies[0], 4, args.api)  # warm-up: first-use builds
        for length in args.lengths:
            for strategy in args.strategies:
                key = str(rng.randint(10000, 99999))
                depth = rng.random()
                text = document(per_filler, length, key, depth, rng.randint(0, 10**6))
                line = {"bench": "long_docs", "length": length, "strategy": strategy}
                line["depth"] = round(depth, 3)
                try:
                    line.update(ask(http, model, text, strategy, args.max_tokens, args.api))
                    line["correct"] = first_number(line["answer"]) == key
                except Exception as exc:  # a cell that fails is reported, the rest still run
                    line["error"] = f"{type(exc).__name__}: {exc}"[:400]
                print(json.dumps(line), flush=True)


def tokens_per_filler(http: httpx.Client, model: str) -> float:
    """Tokens per filler sentence group, as the server's tokenizer counts them (from usage)."""
    counts = []
    for repeats in (1, 41):
        body = {"model": model, "prompt": FILLER * repeats, "max_tokens": 1, "temperature": 0}
        counts.append(http.post("/completions", json=body).json()["usage"]["prompt_tokens"])
    return (counts[1] - counts[0]) / 40


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 131072])
    parser.add_argument("--strategies", nargs="+", default=["segments"])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default="auto", help="the server's --device")
    parser.add_argument("--model", default=None, help="the server's --model (default: embedded)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--api",
        choices=("chat", "completions"),
        default="chat",
        help="chat (a user's way) or completions (the passkey format as bench/passkey.py asks it)",
    )
    run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
