"""Ingest throughput, decode latency against memory size, and memory bytes per token.

Each figure is a ratio measured in one run, so machine noise cancels:
- ingest tokens/s through SessionMemory.append(document=True), as the engine reads an upload,
  vs a bare forward pass of the model over the same tokens in windows of the same chunk size
  (no memory, no retrieval, logits of the last token only: the least work that reads the
  tokens at all), the two interleaved chunk by chunk;
- decode ms/token with a large memory (default 128K tokens) vs a small one (4K), each step a
  decode row as the engine's worker runs it; the small one vs the model's own KV-cache decode
  over the same tokens (when they fit its window), and the large one vs the engine's plain
  decode over the small one's tokens (`ratio_large_memory_vs_engine_plain`), in rounds of
  plain, small, large and plain again: medians of the per-round ratios, and their spread;
- memory bytes per token for each strategy.

    python -m bench.memory_speed --strategies segments tokens neurocache --small 4096 --large 131072
    python -m bench.memory_speed --parts ingest --params '{"read_dtype": "model"}'
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from engine.config import EngineConfig
from engine.memory.band import read_dtype
from engine.memory.session import SessionMemory
from engine.memory.strategies import STRATEGIES
from engine.protocol import MemorySpec
from engine.runner.decode_state import KVCacheState
from engine.runner.decode_step import decode_rows
from engine.runner.loader import load_model


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
        # logits of the last token only, as SessionMemory computes them: the vocabulary
        # projection of every token would be a fifth of this model's forward, work that
        # reading a document does not need
        model(ids[start : start + chunk][None], use_cache=False, logits_to_keep=1)
    return time.perf_counter() - started


@torch.inference_mode()
def decode_ms_per_token(
    memory: SessionMemory, first: int, steps: int, device, last: list[int] | None = None
) -> float:
    """The engine's decode step on the memory: a decode row (engine/runner/rows.py), as the worker
    runs it (through engine/runner/decode_step.py's lean step where the model has one). last[0], if
    given, receives the next input token."""
    token = first
    started = time.perf_counter()
    for _ in range(steps):
        logits = decode_rows(memory.model, [memory.decode_row(token)], [token])[0]
        token = int(logits.argmax())
    elapsed = time.perf_counter() - started
    if last is not None:
        last[:] = [token]
    return 1000 * elapsed / steps


@torch.inference_mode()
def plain_decode_ms_per_token(model, ids: torch.Tensor, steps: int) -> float:
    """Decode ms/token on transformers' own KV cache (DynamicCache) after a prompt of ids, no
    session: the model's plain decode over the same tokens. (The server's plain requests use
    their own cache, engine/runner/kv_cache.py; this is the model's reference, not that path.)"""
    out = model(ids[None], use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
    started = time.perf_counter()
    for _ in range(steps):
        out = model(
            torch.tensor([[token]], device=ids.device), past_key_values=cache, use_cache=True
        )
        cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
    return 1000 * (time.perf_counter() - started) / steps


def measure_ingest(
    model,
    strategy: str,
    ids: torch.Tensor,
    rounds: int,
    params: dict | None = None,
    kv_dtype: str = "model",
) -> dict:
    """Ingest vs bare forward over the same tokens in the same chunks, interleaved chunk by
    chunk (a bare forward of a chunk, then the session reading it, as the engine's ingest
    does) so that both sides run under the same machine load; `rounds` fresh sessions, the
    sums over all of them make the ratio."""
    spec = MemorySpec(strategy, params or {})
    config = SessionMemory(model, spec).config
    chunk = config.chunk_size
    param = next(model.parameters())
    band_dtype = read_dtype(config.read_dtype, param.dtype, param.device)
    bare = ingest = 0.0
    with torch.inference_mode():
        for _ in range(rounds):
            memory = SessionMemory(model, spec, kv_dtype)
            for start in range(0, len(ids), chunk):
                piece = ids[start : start + chunk]
                bare += bare_forward_seconds(model, piece, chunk)
                started = time.perf_counter()
                memory.append(piece, document=True)
                ingest += time.perf_counter() - started
            del memory
    tokens = rounds * len(ids)
    return {
        "bench": "ingest",
        "strategy": strategy,
        "tokens": len(ids),
        "chunk_size": chunk,
        "rounds": rounds,
        **({"params": params} if params else {}),
        "model_dtype": str(param.dtype).removeprefix("torch."),
        "read_band_dtype": str(band_dtype).removeprefix("torch."),
        "ingest_tokens_per_s": round(tokens / ingest, 1),
        "bare_forward_tokens_per_s": round(tokens / bare, 1),
        "ratio": round(bare / ingest, 3),
    }


def measure_decode(
    model,
    strategy: str,
    all_ids: torch.Tensor,
    small: int,
    large: int,
    steps: int,
    kv_dtype: str = "model",
    rounds: int = 5,
) -> list[dict]:
    """Decode ms/token with `small` and `large` tokens of memory against the engine's plain
    decode over the small one's tokens, in `rounds` rounds of `steps` steps each (plain, small,
    large, plain again), so a ratio is taken within a round, under one machine load: medians
    over the rounds, and the spread of the ratios. Bytes per token of each memory."""
    device = all_ids.device
    records: list[dict] = []
    memories: dict[int, list] = {}
    for size in (small, large):
        memory = SessionMemory(model, MemorySpec(strategy), kv_dtype)
        started = time.perf_counter()
        logits = memory.append(all_ids[:size])
        memories[size] = [memory, int(logits.argmax()), time.perf_counter() - started]
    fits = small <= model.config.max_position_embeddings
    plain = None
    if fits:
        plain = KVCacheState(model, small + 2 * rounds * steps + 3, kv_dtype=kv_dtype)
        with torch.inference_mode():
            plain_token = [int(plain.prefill(all_ids[:small]).argmax())]
    times: dict[str, list[float]] = {"small": [], "large": [], "plain": []}
    for size in (small, large):  # a first step builds the step caches: not timed
        last = [memories[size][1]]
        decode_ms_per_token(memories[size][0], last[0], 2, device, last)
        memories[size][1] = last[0]
    if plain is not None:
        _plain_steps(plain, plain_token, 2)
    for _ in range(rounds):
        if plain is not None:
            times["plain"].append(_plain_steps(plain, plain_token, steps))
        for size, name in ((small, "small"), (large, "large")):
            memory, token, _ = memories[size]
            last = [token]
            times[name].append(decode_ms_per_token(memory, token, steps, device, last))
            memories[size][1] = last[0]
        if plain is not None:
            times["plain"][-1] = (times["plain"][-1] + _plain_steps(plain, plain_token, steps)) / 2
    for size, name in ((small, "small"), (large, "large")):
        memory, _, fill = memories[size]
        records.append(
            {
                "bench": "memory",
                "strategy": strategy,
                "memory_tokens": memory.num_tokens,
                "bytes": memory.nbytes(),
                "bytes_per_token": round(memory.nbytes() / max(memory.num_tokens, 1), 1),
                "fill_seconds": round(fill, 2),
                "decode_ms_per_token": round(statistics.median(times[name]), 2),
                "decode_ms_per_round": [round(t, 2) for t in times[name]],
            }
        )
    records.append(
        {
            "bench": "decode",
            "strategy": strategy,
            "small": small,
            "large": large,
            "rounds": rounds,
            **_ratio("ratio_large_vs_small", times["large"], times["small"]),
        }
    )
    del memories
    if fits:
        reference = plain_decode_ms_per_token(model, all_ids[:small], steps)
        small_ms = statistics.median(times["small"])
        records.append(
            {
                "bench": "decode_vs_plain",
                "strategy": strategy,
                "tokens": small,
                "rounds": rounds,
                "plain_kv_decode_ms_per_token": round(reference, 2),
                "ratio_memory_vs_plain": round(small_ms / reference, 3),
                "engine_plain_decode_ms_per_token": round(statistics.median(times["plain"]), 2),
                **_ratio("ratio_large_memory_vs_engine_plain", times["large"], times["plain"]),
            }
        )
    return records


@torch.inference_mode()
def _plain_steps(state: KVCacheState, token: list[int], steps: int) -> float:
    """ms/token of `steps` plain decode steps on state, token[0] the next input (updated)."""
    started = time.perf_counter()
    for _ in range(steps):
        token[0] = int(state.step(token[0]).argmax())
    return 1000 * (time.perf_counter() - started) / steps


def _ratio(name: str, top: list[float], bottom: list[float]) -> dict:
    """The median of the per-round ratios top/bottom, and their spread."""
    ratios = [a / b for a, b in zip(top, bottom, strict=True)]
    return {
        name: round(statistics.median(ratios), 3),
        f"{name}_spread": [round(min(ratios), 3), round(max(ratios), 3)],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--small", type=int, default=4096)
    parser.add_argument("--large", type=int, default=131072)
    parser.add_argument("--ingest-tokens", type=int, default=8192)
    parser.add_argument("--decode-steps", type=int, default=32, help="per round")
    parser.add_argument(
        "--decode-rounds", type=int, default=5, help="rounds of plain, small, large, plain"
    )
    parser.add_argument("--linear-dtype", default="auto", help="auto, bfloat16 or int4")
    parser.add_argument("--rounds", type=int, default=3, help="ingest vs bare forward rounds")
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("ingest", "decode"),
        default=["ingest", "decode"],
        help="which measurements to run",
    )
    parser.add_argument(
        "--params",
        type=json.loads,
        default=None,
        help='memory knobs for the ingest sessions, e.g. \'{"read_dtype": "model"}\'',
    )
    args = parser.parse_args(argv)

    loaded = load_model(EngineConfig(model=args.model, linear_dtype=args.linear_dtype))
    model, tokenizer = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    needed = max(args.ingest_tokens, args.large if "decode" in args.parts else 0)
    all_ids = torch.tensor(random_text_ids(tokenizer, needed, seed=0), device=device)

    def emit(record: dict) -> None:
        print(json.dumps(record), flush=True)

    for strategy in args.strategies:
        if "ingest" in args.parts:
            emit(
                measure_ingest(
                    model,
                    strategy,
                    all_ids[: args.ingest_tokens],
                    args.rounds,
                    args.params,
                    loaded.kv_dtype,
                )
            )
        if "decode" in args.parts:
            for record in measure_decode(
                model,
                strategy,
                all_ids,
                args.small,
                args.large,
                args.decode_steps,
                loaded.kv_dtype,
                args.decode_rounds,
            ):
                emit(record)


if __name__ == "__main__":
    sys.exit(main())
