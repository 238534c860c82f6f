"""Ingest throughput, decode latency against memory size, and memory bytes per token.

Each figure is a ratio measured in one run, so machine noise cancels:
- ingest tokens/s through SessionMemory.append vs a bare forward pass of the model over the same
  tokens in windows of the same chunk size (no memory, no retrieval: the least work that reads
  the tokens at all);
- decode ms/token with a large memory (default 128K tokens) vs a small one (4K);
- memory bytes per token for each strategy.

    python -m bench.memory_speed --strategies segments tokens neurocache --small 4096 --large 131072
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from engine.config import EngineConfig
from engine.loader import load_model
from engine.memory.session import STRATEGIES, SessionMemory
from engine.protocol import MemorySpec


def random_text_ids(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """Prose-like token ids: random words from the tokenizer's vocabulary, n_tokens long."""
    rng = random.Random(seed)
    vocab = [t for t in tokenizer.get_vocab() if t.isalpha() and len(t) > 2][:20000]
    ids: list[int] = []
    while len(ids) < n_tokens:
        words = " ".join(rng.choice(vocab).lstrip("Ġ▁") for _ in range(512)) + "."
        ids.extend(tokenizer(words, add_special_tokens=False).input_ids)
    return ids[:n_tokens]


@torch.inference_mode()
def bare_forward_seconds(model, ids: torch.Tensor, chunk: int) -> float:
    started = time.perf_counter()
    for start in range(0, len(ids), chunk):
        model(ids[start : start + chunk][None], use_cache=False)
    return time.perf_counter() - started


@torch.inference_mode()
def decode_ms_per_token(memory: SessionMemory, first: int, steps: int, device) -> float:
    token = first
    started = time.perf_counter()
    for _ in range(steps):
        logits = memory.append(torch.tensor([token], device=device))
        token = int(logits.argmax())
    return 1000 * (time.perf_counter() - started) / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--small", type=int, default=4096)
    parser.add_argument("--large", type=int, default=131072)
    parser.add_argument("--ingest-tokens", type=int, default=8192)
    parser.add_argument("--decode-steps", type=int, default=32)
    args = parser.parse_args(argv)

    loaded = load_model(EngineConfig(model=args.model))
    model, tokenizer = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    all_ids = torch.tensor(random_text_ids(tokenizer, args.large, seed=0), device=device)

    def emit(record: dict) -> None:
        print(json.dumps(record), flush=True)

    for strategy in args.strategies:
        # Ingest vs bare forward, same tokens, same chunk size, measured back to back.
        memory = SessionMemory(model, MemorySpec(strategy))
        chunk = memory.config.chunk_size
        ids = all_ids[: args.ingest_tokens]
        bare = bare_forward_seconds(model, ids, chunk)
        started = time.perf_counter()
        memory.append(ids)
        ingest = time.perf_counter() - started
        emit({"bench": "ingest", "strategy": strategy, "tokens": len(ids), "chunk_size": chunk,
              "ingest_tokens_per_s": round(len(ids) / ingest, 1),
              "bare_forward_tokens_per_s": round(len(ids) / bare, 1),
              "ratio": round(bare / ingest, 3)})
        del memory

        # Decode latency with a small and a large memory.
        results = {}
        for size in (args.small, args.large):
            memory = SessionMemory(model, MemorySpec(strategy))
            started = time.perf_counter()
            logits = memory.append(all_ids[:size])
            fill = time.perf_counter() - started
            results[size] = decode_ms_per_token(memory, int(logits.argmax()), args.decode_steps, device)
            emit({"bench": "memory", "strategy": strategy, "memory_tokens": memory.num_tokens,
                  "bytes": memory.nbytes(),
                  "bytes_per_token": round(memory.nbytes() / max(memory.num_tokens, 1), 1),
                  "fill_seconds": round(fill, 2),
                  "decode_ms_per_token": round(results[size], 2)})
            del memory
        emit({"bench": "decode", "strategy": strategy, "small": args.small, "large": args.large,
              "ratio_large_vs_small": round(results[args.large] / results[args.small], 3)})


if __name__ == "__main__":
    sys.exit(main())
