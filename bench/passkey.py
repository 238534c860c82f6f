"""Passkey retrieval accuracy by context length and memory strategy.

The landmark format of Mohtashami & Jaggi, as quoted in the Larimar paper's footnote: a random
5-digit pass key planted at a uniform random depth in repeated filler, and the question "What is
the pass key? The pass key is". The answer is scored by the first number generated (greedy).

Every cell runs through the engine's SessionMemory (the whole prompt is appended into the memory,
then a few tokens are decoded; the filler the prompts of a cell share is read once and forked,
which gives the same forwards, see `answers_sharing_prefix`), and the same run measures the
model's own full attention at a length that fits its window (the baseline). One JSON line per cell on stdout:

    python -m bench.passkey --lengths 4096 16384 32768 --strategies segments tokens neurocache -n 10

--memory-dtypes measures every cell once per memory_dtype (float16 against int8 in one run,
the same keys at the same depths); each line then carries `memory_dtype`. --served reads with
the text prior attached and answers as the server does (`answer_read`, by default the frame's
tokens read afresh: engine/sessions/frame_text.py); without it, over the stored keys and values.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from typing import Any

import torch

from engine.config import EngineConfig
from engine.memory.session import SessionMemory
from engine.memory.strategies import STRATEGIES
from engine.protocol import MemorySpec
from engine.runner.loader import load_model
from engine.sessions.frame_text import FrameTextState
from engine.sessions.memory_state import MemoryState
from engine.sessions.prior_query import prior_encoder, prior_query

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "them. I will quiz you about the important information there."
)
FILLER = (
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
QUESTION = " What is the pass key? The pass key is"


def passkey_prompt(tokenizer, n_tokens: int, key: str, depth: float) -> list[int]:
    """Token ids of a prompt of about n_tokens with the key planted at `depth` (0..1)."""
    needle = f" The pass key is {key}. Remember it. {key} is the pass key."
    fixed = len(tokenizer(INTRO + needle + QUESTION, add_special_tokens=False).input_ids)
    per_filler = len(tokenizer(FILLER * 20, add_special_tokens=False).input_ids) / 20
    repeats = max(1, int((n_tokens - fixed) / per_filler))
    before = int(round(repeats * depth))
    text = INTRO + FILLER * before + needle + FILLER * (repeats - before) + QUESTION
    return tokenizer(text, add_special_tokens=False).input_ids


def first_number(text: str) -> str | None:
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


@torch.inference_mode()
def answer_with_memory(
    model, tokenizer, ids: list[int], spec: MemorySpec, new_tokens: int, kv_dtype: str = "model"
):
    memory = SessionMemory(model, spec, kv_dtype)
    return decode_answer(tokenizer, memory, ids, new_tokens)


def decode_answer(
    tokenizer,
    memory: SessionMemory,
    ids: list[int],
    new_tokens: int,
    question: str = "",
    kv_dtype: str = "model",
    read: int = 0,
):
    """Append ids[read:] to memory, which holds ids[:read] (a question: its tail forwarded on
    its own), decode greedily. With the text prior attached, the question is its query, the
    prompt's body is an inline document as the server cuts it (everything before the tail,
    moved to memory once read), and the answer reads as the server's (answer_read)."""
    device = next(memory.model.parameters()).device
    body = memory.config.tail_start(len(ids))  # engine/sessions/frame_backend.py's cut
    served = memory.prior is not None and read < body < len(ids)
    state: Any = MemoryState(memory, None, body if served else None, read=read)
    if memory.prior is not None:
        memory.set_query(prior_query(question))
        if memory.config.answer_read == "afresh":
            state = FrameTextState(state, memory.model, kv_dtype)
    logits = state.prefill(torch.tensor(ids[read:], device=device))
    out: list[int] = []
    for _ in range(new_tokens):
        token = int(logits.argmax())
        out.append(token)
        logits = state.step(token)
    return tokenizer.decode(out), memory


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@torch.inference_mode()
def answers_sharing_prefix(
    model,
    tokenizer,
    prompts: list[list[int]],
    spec: MemorySpec,
    new_tokens: int,
    kv_dtype: str = "model",
    prior: tuple[Any, Any] | None = None,
):
    """Answer every prompt of a cell, reading the opening they share only once.

    The prompts of one cell differ only from their needle on (same intro, same filler), so
    taken shallowest needle first, a base memory reads, in whole chunks, the tokens the prompt
    shares with every deeper one, and each prompt is answered on a fork of it (a copy: no
    forward) that appends the rest. Chunks are cut at the same multiples of chunk_size as
    appending the whole prompt at once, and a chunk of a prompt that long does not retrieve,
    so every forward is the one the whole prompt would get: the answers are the same, the
    shared filler is forwarded once instead of once per prompt. Pass the prompts shallowest
    needle first (any order is exact, that one shares most). kv_dtype: the frames' sinks and
    window, as the server holds them (LoadedModel.kv_dtype). Yields (index, text, memory)."""
    base = SessionMemory(model, spec, kv_dtype)
    if prior is not None:  # (encoder, decode): the text prior, as the server attaches it
        base.attach_prior(*prior)
    chunk = base.config.chunk_size
    device = next(model.parameters()).device
    read = 0
    for i, ids in enumerate(prompts):
        shared = min((common_prefix(ids, later) for later in prompts[i + 1 :]), default=0)
        body = base.config.tail_start(len(ids))  # where a whole-prompt append's chunks end
        if read > body:  # cannot happen for prompts of one length; stay exact if it does
            yield i, *answer_with_memory(model, tokenizer, ids, spec, new_tokens, kv_dtype)
            continue
        cut = max(read, min(shared, body - 1) // chunk * chunk)  # the document ends in the fork
        if cut > read:
            base.append(torch.tensor(ids[read:cut], device=device), document=True)
            read = cut
        memory = base.fork() if i + 1 < len(prompts) else base
        question = str(tokenizer.decode(ids[-64:])) if prior is not None else ""
        text, memory = decode_answer(tokenizer, memory, ids, new_tokens, question, kv_dtype, read)
        yield i, text, memory
        # the caller is done with this fork: drop it before the next one is made, so at most
        # the base and one fork are alive (a 32K tokens-strategy cell was OOM-killed at 24 GB)
        del memory


@torch.inference_mode()
def answer_full_attention(model, tokenizer, ids: list[int], new_tokens: int) -> str:
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    out = model.generate(
        input_ids,
        max_new_tokens=new_tokens,
        do_sample=False,
        attention_mask=torch.ones_like(input_ids),
    )
    return tokenizer.decode(out[0, len(ids) :])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir or hub id (default: embedded)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument(
        "--linear-dtype", default="auto", help="auto, bfloat16 or int4 linear weights"
    )
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--baseline-length", type=int, default=2048)
    parser.add_argument("-n", "--samples", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="strategy knob, e.g. --param k=16 (applies to every strategy)",
    )
    parser.add_argument(
        "--memory-dtypes",
        nargs="+",
        choices=("auto", "model", "float16", "int8"),
        help="memory_dtype of each cell, measured in turn (default: the knobs' own)",
    )
    parser.add_argument(
        "--served",
        action="store_true",
        help="the text prior attached and the answer read as the server does (answer_read)",
    )
    args = parser.parse_args(argv)

    params = {}
    for item in args.param:
        key, _, value = item.partition("=")
        params[key] = json.loads(value)

    loaded = load_model(EngineConfig(model=args.model, linear_dtype=args.linear_dtype))
    model, tokenizer = loaded.model, loaded.tokenizer
    prior = None
    if args.served:
        encoder = prior_encoder(EngineConfig())
        prior = None if encoder is None else (encoder, lambda t: str(tokenizer.decode(list(t))))
    rng = random.Random(args.seed)
    cases = [(str(rng.randint(10000, 99999)), rng.random()) for _ in range(args.samples)]

    def emit(record: dict) -> None:
        print(json.dumps(record), flush=True)

    hits, started = 0, time.perf_counter()
    for key, depth in cases:
        ids = passkey_prompt(tokenizer, args.baseline_length, key, depth)
        hits += first_number(answer_full_attention(model, tokenizer, ids, args.new_tokens)) == key
    emit(
        {
            "bench": "passkey",
            "strategy": "full_attention",
            "tokens": args.baseline_length,
            "n": len(cases),
            "accuracy": hits / len(cases),
            "seconds": round(time.perf_counter() - started, 2),
        }
    )

    by_depth = sorted(cases, key=lambda case: case[1])  # shallowest first: most shared
    variants = [
        (strategy, dtype) for strategy in args.strategies for dtype in args.memory_dtypes or [None]
    ]
    for strategy, dtype in variants:
        knobs = params if dtype is None else {**params, "memory_dtype": dtype}
        for length in args.lengths:
            hits, started, misses = 0, time.perf_counter(), []
            memory_bytes, held_bytes, memory_tokens = 0, 0, 0
            prompts = [passkey_prompt(tokenizer, length, key, depth) for key, depth in by_depth]
            spec = MemorySpec(strategy, knobs)
            answers = answers_sharing_prefix(
                model, tokenizer, prompts, spec, args.new_tokens, loaded.kv_dtype, prior
            )
            for i, text, memory in answers:
                key, depth = by_depth[i]
                got = first_number(text)
                hits += got == key
                if got != key:
                    misses.append({"depth": round(depth, 3), "key": key, "answer": text})
                memory_bytes, memory_tokens = memory.nbytes(), memory.num_tokens
                memory.end_request()  # as a session between requests: no decode-step caches
                held_bytes = memory.nbytes()
                del memory
            del answers
            emit(
                {
                    "bench": "passkey",
                    "strategy": strategy,
                    "params": knobs,
                    "served": prior is not None,
                    **({"memory_dtype": dtype} if dtype is not None else {}),
                    "tokens": length,
                    "n": len(cases),
                    "accuracy": hits / len(cases),
                    "seconds": round(time.perf_counter() - started, 2),
                    "memory_bytes_per_token": round(memory_bytes / max(memory_tokens, 1), 1),
                    "held_bytes_per_token": round(held_bytes / max(memory_tokens, 1), 1),
                    "misses": misses[:5],
                }
            )


if __name__ == "__main__":
    sys.exit(main())
