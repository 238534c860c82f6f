"""A batched decode step of B memory rows against one, in process (issue #16's lever).

A --tokens document of real text is read once into a session (segments by default; --knobs
adds memory knobs), forked B times, and `decode_batch` steps all forks in one forward, as the
server batches concurrent questions on memory. For each --kv-dtypes entry (what sinks and
window hold; default the server's), each --memory-dtypes entry and each --rows B: the median
ms per step over --steps after two warm-up steps, and the tokens/s of B rows relative to one
row. The text prior is off unless --knobs sets prior_k, so set k to fill the retrieval budget
(the default knobs give 3,072 retrieved rows, as a server session has).

    longserve bench memory_batch --rows 1 8 --memory-dtypes model float16
    longserve bench memory_batch --rows 1 2 4 8 --memory-dtypes float16 int8
    longserve bench memory_batch --rows 1 8 --memory-dtypes auto --kv-dtypes float16 model
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.recall_corpus import filler, load_token_counter
from engine.config import EngineConfig
from engine.memory.session import SessionMemory
from engine.protocol import MemorySpec
from engine.runner.decode_state import decode_batch
from engine.runner.loader import LoadedModel, load_model
from engine.sessions.memory_state import MemoryState


def step_ms(model, memory: SessionMemory, strategy: str, rows: int, token: int, steps: int):
    """Median ms of a decode step of `rows` forks of memory, after two warm-up steps."""
    states = [MemoryState(memory.fork(), strategy) for _ in range(rows)]
    tokens, times = [token] * rows, []
    with torch.inference_mode():
        for _ in range(steps + 2):
            started = time.perf_counter()
            logits = decode_batch(model, states, tokens)
            times.append(time.perf_counter() - started)
            tokens = logits.argmax(-1).tolist()
    return statistics.median(times[2:]) * 1000


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
    args = parser.parse_args(argv)

    loaded = load_model(EngineConfig(model=args.model, linear_dtype=args.linear_dtype))
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


if __name__ == "__main__":
    main()
