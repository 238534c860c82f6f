"""A batched decode step of B memory rows against one, in process (issue #16's lever).

A --tokens document of real text is read once into a session (segments by default; --knobs
adds memory knobs), forked B times (each fork with keys and values of its own, as distinct
sessions hold: `fork(private=True)`), and `decode_batch` steps all forks in one forward, as the
server batches concurrent questions on memory. For each --kv-dtypes entry (what sinks and
window hold; default the server's), each --memory-dtypes entry and each --rows B: the median
ms per step over --steps after two warm-up steps, and the tokens/s of B rows relative to one
row. The text prior is off unless --knobs sets prior_k, so set k to fill the retrieval budget
(the default knobs give 3,072 retrieved rows, as a server session has).

Then, per cell, a row's own cost and its floor (issue #43): `per_row_ms` is what each row past
the first --rows entry adds to a step (the slope from the fewest to the most rows); the floor is
reading one row's frame once, at the precision memory holds it, at this machine's streaming
read bandwidth (a 2-thread read of a 512 MB buffer, measured in the same run). The frame's bytes
are counted from the pieces one step hands the attention kernel (sinks, retrieved rows, window,
the token), 30 layers of keys and values; `frame_mb_held` counts the retrieved rows as memory
holds them (int8: codes plus scales), `frame_mb_read` as the kernel reads them (the same where
it reads int8 codes in place; a widened float16 copy where it cannot).

    longserve bench memory_batch --rows 1 8 --memory-dtypes model float16
    longserve bench memory_batch --rows 1 2 4 8 --memory-dtypes float16 int8
    longserve bench memory_batch --rows 1 8 --memory-dtypes auto --kv-dtypes float16 model
    longserve bench memory_batch --rows 1 8 --memory-dtypes float16 int8 --afresh

--afresh adds, per cell, the rows an answer read afresh decodes on (answer_read "afresh", the
default): a plain KV cache (the loaded model's kv dtype) of the frame's tokens, its per-row
cost against the floor of reading that cache once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from unittest import mock

import torch

from bench.recall_corpus import filler, load_token_counter
from engine.config import EngineConfig
from engine.memory import step_cache
from engine.memory.session import SessionMemory
from engine.protocol import MemorySpec
from engine.runner.decode_state import KVCacheState, decode_batch
from engine.runner.loader import LoadedModel, load_model
from engine.sessions.memory_state import MemoryState


def step_ms(model, memory: SessionMemory, strategy: str, rows: int, token: int, steps: int):
    """Median ms of a decode step of `rows` forks of memory, after two warm-up steps."""
    # each row its own frame, as distinct sessions hold (forks would share the rows)
    states = [MemoryState(memory.fork(private=True), strategy) for _ in range(rows)]
    return median_step_ms(model, states, token, steps)


def median_step_ms(model, states: list, token: int, steps: int) -> float:
    """Median ms of a decode step of every state at once, greedy from token, after two warm-up
    steps."""
    tokens, times = [token] * len(states), []
    with torch.inference_mode():
        for _ in range(steps + 2):
            started = time.perf_counter()
            logits = decode_batch(model, states, tokens)
            times.append(time.perf_counter() - started)
            tokens = logits.argmax(-1).tolist()
    return statistics.median(times[2:]) * 1000


def frame_bytes(model, memory: SessionMemory, strategy: str, token: int) -> tuple[int, int, int]:
    """(read, held, tokens): the bytes of keys and values one row's decode step hands the
    attention kernel over all layers, the same with the retrieved piece counted as memory holds
    it, and the frame's tokens (keys per KV head in a layer)."""
    read = held = 0
    tokens: list[int] = []
    dtype, block = memory.config.memory_dtype, memory.config.block
    real = step_cache.attend_pieces

    def counting(queries, keys, values, masks, scale, rows=None, params=None, group=0):
        nonlocal read, held
        rows, given = rows or [None] * len(keys), params or [None] * len(keys)
        sizes = [k.shape[1] if r is None else r.shape[1] for k, r in zip(keys, rows, strict=True)]
        tokens.append(sum(sizes))
        for i, (k, p) in enumerate(zip(keys, given, strict=True)):
            heads, n, d = k.shape[0], sizes[i], k.shape[2]
            # int8 codes read in place come with their scales; anything else is read as is
            size = (
                int8_bytes(heads, n, d, block)
                if p is not None
                else 2 * heads * n * d * k.element_size()
            )
            read += size
            retrieved = len(keys) == 4 and i == 1  # [sinks, retrieved, window, the token]
            held += int8_bytes(heads, n, d, block) if retrieved and dtype == "int8" else size
        return real(queries, keys, values, masks, scale, rows, params, group)

    state = MemoryState(memory.fork(), strategy)
    with mock.patch.object(step_cache, "attend_pieces", counting), torch.inference_mode():
        decode_batch(model, [state], [token])
    return read, held, tokens[0]


def afresh_ms(loaded: LoadedModel, ids: torch.Tensor, rows: list[int], steps: int) -> dict:
    """ms per decode step of B rows on a plain KV cache of ids (the frame's tokens), as an
    answer read afresh decodes (answer_read "afresh", the default: engine/sessions/frame_text.py),
    for each B in rows; the prompt read once and copied to every row."""
    first = KVCacheState(loaded.model, max_tokens=len(ids) + steps + 2, kv_dtype=loaded.kv_dtype)
    with torch.inference_mode():
        token = int(first.prefill(ids).argmax())
    kv = first.cache.prefix(len(ids))
    out = {}
    for b in rows:
        states = []
        for _ in range(b):
            state = KVCacheState(loaded.model, len(ids) + steps + 2, loaded.kv_dtype)
            state.cache.start_from(kv)
            states.append(state)
        out[b] = median_step_ms(loaded.model, states, token, steps)
    return out


def int8_bytes(heads: int, n: int, d: int, block: int) -> int:
    """Bytes of n retrieved rows' keys and values held in int8: a byte per element, values a
    float16 (scale, zero) per row, keys one per channel per block (engine/memory/quantized.py).
    Other dtypes are read in place: held as read."""
    return heads * (2 * n * d + 4 * n + 4 * d * -(-n // block))


def kv_bytes(model, tokens: int, kv_dtype: str) -> int:
    """Bytes of a plain KV cache of `tokens` tokens: every layer's keys and values."""
    cfg = model.config
    heads = cfg.num_key_value_heads or cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype if kv_dtype == "model" else getattr(torch, kv_dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    return cfg.num_hidden_layers * 2 * heads * tokens * d * size


def stream_gbps(megabytes: int = 512, repeats: int = 5) -> float:
    """This machine's streaming read bandwidth in GB/s: the best of `repeats` sums of a
    float32 buffer, on torch's threads."""
    buf = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats + 1):
        started = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - started)
    return buf.numel() * 4 / best / 1e9


def per_row(ms: dict[int, float]) -> float:
    """ms a step adds per row: the slope from the fewest to the most rows measured."""
    few, many = min(ms), max(ms)
    return (ms[many] - ms[few]) / (many - few) if many > few else float("nan")


def document_ids(loaded: LoadedModel, model: str | None, seed: str, tokens: int) -> torch.Tensor:
    """The first `tokens` ids (T,) of installed documentation, in `seed`'s order."""
    counter = load_token_counter(model)
    text = "\n\n".join(p for p, _ in filler("docs", seed, tokens + 800, counter))
    return torch.tensor(loaded.tokenizer(text).input_ids[:tokens])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--linear-dtype", default="auto", help="auto, bfloat16 or int4")
    parser.add_argument("--strategy", default="segments")
    parser.add_argument("--knobs", type=json.loads, default={"k": 16, "prior_k": 0})
    parser.add_argument("--memory-dtypes", nargs="+", default=["model", "float16"])
    parser.add_argument(
        "--kv-dtypes", nargs="+", default=None, help="sinks and window: model, float16"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--afresh",
        action="store_true",
        help="also rows on a plain KV cache of the frame's tokens, as answers read afresh decode",
    )
    args = parser.parse_args(argv)

    loaded = load_model(EngineConfig(model=args.model, linear_dtype=args.linear_dtype))
    gbps = stream_gbps()
    ids = document_ids(loaded, args.model, "memory-batch", args.tokens)
    cells = [(kv, m) for kv in args.kv_dtypes or [loaded.kv_dtype] for m in args.memory_dtypes]
    for kv_dtype, memory_dtype in cells:
        knobs = {**args.knobs, "memory_dtype": memory_dtype}
        memory = SessionMemory(loaded.model, MemorySpec(args.strategy, knobs), kv_dtype)
        with torch.inference_mode():
            token = int(memory.append(ids).argmax())
        ms = {rows: step_ms(loaded.model, memory, args.strategy, rows, token, args.steps)
              for rows in args.rows}  # fmt: skip
        first = args.rows[0]
        for rows, value in ms.items():
            line = {
                "bench": "memory_batch",
                "strategy": args.strategy,
                "knobs": knobs,
                "kv_dtype": kv_dtype,
                "tokens": len(ids),
                "rows": rows,
                "step_ms": round(value, 1),
                "tokens_per_s": round(rows * 1000 / value, 1),
                f"vs_{first}_rows": round(rows * ms[first] / (first * value), 2),
            }
            print(json.dumps(line), flush=True)
        read, held, frame_tokens = frame_bytes(loaded.model, memory, args.strategy, token)
        cost, floor = per_row(ms), held / gbps / 1e6
        summary = {
            "bench": "memory_batch",
            "memory_dtype": memory_dtype,
            "kv_dtype": kv_dtype,
            "rows": sorted(ms),
            "per_row_ms": round(cost, 2),
            "frame_mb_read": round(read / 1e6, 1),
            "frame_mb_held": round(held / 1e6, 1),
            "read_gbps": round(gbps, 1),
            "floor_ms": round(floor, 2),
            "per_row_vs_floor": round(cost / floor, 2),
        }
        print(json.dumps(summary), flush=True)
        if args.afresh:
            fresh = afresh_ms(loaded, ids[:frame_tokens], args.rows, args.steps)
            cache = kv_bytes(loaded.model, frame_tokens, loaded.kv_dtype)
            cost, floor = per_row(fresh), cache / gbps / 1e6
            line = {
                "bench": "memory_batch",
                "answer_read": "afresh",
                "memory_dtype": memory_dtype,
                "kv_dtype": loaded.kv_dtype,
                "frame_tokens": frame_tokens,
                "step_ms": {b: round(v, 1) for b, v in fresh.items()},
                "per_row_ms": round(cost, 2),
                "cache_mb": round(cache / 1e6, 1),
                "read_gbps": round(gbps, 1),
                "floor_ms": round(floor, 2),
                "per_row_vs_floor": round(cost / floor, 2),
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
