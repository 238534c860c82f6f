"""longserve vs llama.cpp vs transformers' generate: prefill and decode tokens/s, one run.

The same GGUF (the embedded SmolLM2-135M-Instruct unless --gguf), the same prompt token ids of
real text at each --contexts length, greedy, exactly --max-tokens new tokens, one stream:

- longserve through its HTTP API (a server started here: streaming /v1/completions of the
  prompt's text, which the server tokenizes back to the same ids, ignore_eos),
- llama.cpp in this process (llama-cpp-python on the same GGUF, --threads threads; install it
  in the benchmark's environment: `pip install llama-cpp-python==0.3.36`, never a test
  dependency; on a CPU with AMX its default build segfaulted on the first decode, so build it
  there with ggml's AMX backend off, as the README's peers row says),
- transformers' own `generate` on the model longserve loads (fp32, eager; on a GPU the
  dtype a transformers user gets there, bfloat16), in this process.

`--peers` picks a subset (llama.cpp is left out where its build is not installed, e.g. on a
GPU machine with no registry); `--device cuda` runs the server and the transformers reference
on the GPU.

Prefill tokens/s: prompt tokens over the time to the first new token. Decode tokens/s: the
new tokens after the first over the time after it. Peers alternate within each round; one JSON
line per measurement, then per context the medians and longserve's ratios to each peer.

    longserve bench peers --contexts 512 4096 8000 --rounds 2
    longserve bench peers --device cuda --peers longserve transformers
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import httpx

from bench.recall_corpus import filler, load_token_counter
from bench.server_process import served

PEERS = ("longserve", "llama.cpp", "transformers")


def prompt_ids(tokenizer: Any, tokens: int) -> list[int]:
    text = "\n\n".join(p for p, _ in filler("docs", "peers", tokens + 64, load_token_counter(None)))
    return list(tokenizer(text).input_ids)[:tokens]


def timed(stream: Any, prompt_len: int) -> dict:
    """Prefill and decode tokens/s from an iterator of new tokens, started now."""
    started = time.perf_counter()
    stamps = [time.perf_counter() for _ in stream]
    if not stamps:
        raise RuntimeError("the peer produced no tokens")
    first = stamps[0] - started
    decode = stamps[-1] - stamps[0]
    return {
        "new_tokens": len(stamps),
        "prefill_tok_s": round(prompt_len / first, 1),
        "decode_tok_s": round((len(stamps) - 1) / decode, 2) if decode > 0 else None,
    }


def longserve_tokens(http: httpx.Client, model: str, text: str, n: int):
    body = {
        "model": model,
        "prompt": text,
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with http.stream("POST", "/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    yield chunk


def llama_tokens(llm: Any, ids: list[int], n: int):
    llm.reset()
    for i, token in enumerate(llm.generate(ids, top_k=1, top_p=1.0, temp=0.0)):
        yield token
        if i + 1 == n:
            return


class _Stamps:
    """A transformers streamer that yields a mark per new token, from the generate thread."""

    def __init__(self) -> None:
        import queue

        self.queue: Any = queue.Queue()
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:  # generate's first put is the prompt
            self.prompt_seen = True
            return
        self.queue.put(1)

    def end(self) -> None:
        self.queue.put(None)

    def __iter__(self):
        while (item := self.queue.get()) is not None:
            yield item


def transformers_tokens(model: Any, ids: list[int], n: int):
    import threading

    import torch

    streamer = _Stamps()
    inputs = torch.tensor([ids], device=model.device)
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=streamer)
    thread = threading.Thread(target=model.generate, args=(inputs,), kwargs=kwargs)
    thread.start()
    yield from streamer
    thread.join()


def llama_model(gguf: str, threads: int) -> Any:
    """llama.cpp on `gguf` in this process (imported only here: no build, no peer)."""
    from llama_cpp import Llama

    return Llama(
        model_path=gguf,
        n_ctx=8192,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        verbose=False,
    )


def time_peers(
    peers: dict[str, Callable[[list[int]], Iterable[Any]]],
    tokenizer: Any,
    contexts: Sequence[int],
    rounds: int,
) -> Iterator[dict]:
    """Warm every peer once, then per context and round time each peer in turn on the same
    prompt ids: one line per measurement (context, round, peer and `timed`'s figures)."""
    warm = prompt_ids(tokenizer, 64)
    for tokens_of in peers.values():
        list(tokens_of(warm))
    for context in contexts:
        ids = prompt_ids(tokenizer, context)
        for round_ in range(rounds):
            for peer, tokens_of in peers.items():
                line = {"context": len(ids), "round": round_, "peer": peer}
                yield {**line, **timed(tokens_of(ids), len(ids))}


def summarize(lines: list[dict], peers: Sequence[str]) -> list[dict]:
    """Per context: each peer's median prefill and decode tokens/s, and longserve's ratios to
    every other peer (`longserve/<peer>_<figure>`)."""
    out = []
    for context in sorted({x["context"] for x in lines}):
        med: dict[str, dict[str, float]] = {}
        for peer in peers:
            rows = [x for x in lines if x["context"] == context and x["peer"] == peer]
            med[peer] = {
                key: statistics.median(r[key] for r in rows if r[key])
                for key in ("prefill_tok_s", "decode_tok_s")
            }
        ratios = {
            f"longserve/{peer}_{key}": round(med["longserve"][key] / med[peer][key], 2)
            for peer in peers
            if peer != "longserve" and "longserve" in med
            for key in ("prefill_tok_s", "decode_tok_s")
        }
        out.append({"context": context, "median": med, **ratios})
    return out


def run(args: argparse.Namespace) -> None:
    import torch

    from engine.config import EngineConfig
    from engine.runner.loader import embedded_model_path, load_model

    torch.set_num_threads(args.threads)
    gguf = args.gguf or str(embedded_model_path())
    # transformers' generate runs the reference a user of transformers gets: fp32 eager on a
    # CPU, the device's default dtype (bfloat16) on a GPU
    linear = "float32" if args.device == "cpu" else "auto"
    loaded = load_model(EngineConfig(model=args.gguf, device=args.device, linear_dtype=linear))
    serve_args = ["--model", gguf] if args.gguf else []
    serve_args += ["--device", args.device]
    lines: list[dict] = []
    # prefill timed from the prompt's first token, as llama.cpp's after llm.reset(): no reuse
    no_reuse = {"LONGSERVE_KV_PREFIX_CACHE_BYTES": "0"}
    with served(None, serve_args=serve_args, env=no_reuse, ready_timeout=300) as base:
        http = httpx.Client(base_url=f"{base}/v1", timeout=3600)
        model = http.get("/models").json()["data"][0]["id"]
        every = {
            "longserve": lambda ids: longserve_tokens(
                http, model, loaded.tokenizer.decode(ids), args.max_tokens
            ),
            "transformers": lambda ids: transformers_tokens(loaded.model, ids, args.max_tokens),
        }
        if "llama.cpp" in args.peers:
            llm = llama_model(gguf, args.threads)
            every["llama.cpp"] = lambda ids: llama_tokens(llm, ids, args.max_tokens)
        peers = {name: every[name] for name in args.peers}
        for line in time_peers(peers, loaded.tokenizer, args.contexts, args.rounds):
            line = {"bench": "peers", **line}
            print(json.dumps(line), flush=True)
            lines.append(line)
    for summary in summarize(lines, args.peers):
        print(json.dumps({"bench": "peers", **summary}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 8000])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", help="a GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (server and reference)")
    parser.add_argument(
        "--peers", nargs="+", default=list(PEERS), choices=PEERS, help="which to run"
    )
    args = parser.parse_args(argv)
    run(args)


if __name__ == "__main__":
    sys.exit(main())
