"""The Larimar paper's passkey test through longserve's `larimar` strategy.

Context (the paper's footnote 4, after Mohtashami & Jaggi): the intro, the filler repeated x
times, "The pass key is 9054. Remember it. 9054 is the pass key.", the filler repeated y times,
then "What is the pass key? The pass key is". The key is a random 5-digit number at a uniform
random depth; x + y is set so the whole context has about `length` SmolLM2 tokens (tokens per
filler repeat are counted once, the text is built by repetition; each length's first context is
tokenized once to report its exact size).

Per trial, through the real pieces: everything but the final partial sentence is written,
sentence by sentence, to a LarimarStore over an EmbeddedBackend in a temp dir (one-hot writing
keys from 4-word prefixes, so every repeat of a sentence lands in the same slot; identical
sentences are encoded once) and saved; the memory is read with "The pass key is"; the embedded
SmolLM2-135M-Instruct generates greedily from the conditioned prompt; the first number generated
is the answer. One JSON line per length on stdout:

    python -m bench.larimar_passkey --lengths 131072 1048576 -n 10

Fields: accuracy (first generated number == key), retrieval_accuracy (the needle sentence is in
the conditioned prompt), write_seconds (segment + encode + solve + save, mean per trial; the
split of the final partial sentence off the prompt is not timed), ingest_tokens_per_s,
read_seconds, generate_seconds, segments_written, memory_slots, stored_bytes (the saved memory),
peak_rss_mb (process-wide ru_maxrss, monotonic, so lengths run in ascending order) and
peak_rss_after_load_mb (both models loaded, nothing written yet).

With --top-k 1 (the paper's single nearest key row) the prompt is "The pass key is N.\nThe pass
key is" and SmolLM2-135M tends to continue the list with N+1; the default top_k=3 also brings
"N is the pass key." and "What is the pass key?", which it answers correctly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.runner.loader import load_model
from engine.sessions.larimar import LarimarParams, LarimarReader
from engine.sessions.larimar_prompt import split_context
from memory_store.backends import EmbeddedBackend
from memory_store.embedder import default_embedder

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "them. I will quiz you about the important information there."
)
FILLER = (
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
QUESTION = " What is the pass key? The pass key is"


def needle(key: int) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key."


def tokens_per_filler(tokenizer) -> float:
    return len(tokenizer(FILLER * 50, add_special_tokens=False).input_ids) / 50


def passkey_context(tokenizer, length: int, key: int, depth: float, per_filler: float) -> str:
    fixed = len(tokenizer(INTRO + needle(key) + QUESTION, add_special_tokens=False).input_ids)
    repeats = max(1, round((length - fixed) / per_filler))
    before = round(repeats * depth)
    return INTRO + FILLER * before + needle(key) + FILLER * (repeats - before) + QUESTION


def first_number(text: str) -> str | None:
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


@torch.inference_mode()
def greedy(model, tokenizer, prompt: str, new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    out = model.generate(
        ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


async def run_length(
    model,
    tokenizer,
    length: int,
    n: int,
    params: LarimarParams,
    rng: random.Random,
    new_tokens: int,
    verbose: bool,
    rss_after_load_mb: float,
) -> dict:
    per_filler = tokens_per_filler(tokenizer)
    correct = found = 0
    write_s: list[float] = []
    read_s: list[float] = []
    gen_s: list[float] = []
    tokens: list[int] = []
    slots = segments = stored = 0
    misses: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="larimar-bench-") as tmp:
        backend = EmbeddedBackend(Path(tmp) / "store")
        reader = LarimarReader.in_process(backend, params)
        for trial in range(n):
            key = rng.randint(10000, 99999)
            depth = rng.random()
            text = passkey_context(tokenizer, length, key, depth, per_filler)
            if trial == 0:  # the exact size once per length; the others differ by a few tokens
                exact = len(tokenizer(text, add_special_tokens=False).input_ids)
            tokens.append(exact)
            document, question = split_context(text)
            session = f"bench-{length}-{trial}"

            start = time.perf_counter()
            segments = await reader.write(session, document)
            write_s.append(time.perf_counter() - start)
            info = await reader.client.larimar_load(session)  # from disk: proves it is durable
            slots = info["slots"]
            stored = dir_bytes(Path(tmp))

            start = time.perf_counter()
            prompt = await reader.conditioned_prompt(session, question)
            read_s.append(time.perf_counter() - start)

            start = time.perf_counter()
            answer = greedy(model, tokenizer, prompt, new_tokens)
            gen_s.append(time.perf_counter() - start)
            ok = first_number(answer) == str(key)
            found += f"The pass key is {key}." in prompt  # the readout found the needle's slot
            correct += ok
            if not ok:
                misses.append({"key": key, "depth": round(depth, 3), "answer": answer})
            if verbose:
                print(
                    json.dumps(
                        {
                            "trial": trial,
                            "key": key,
                            "depth": round(depth, 3),
                            "prompt": prompt,
                            "answer": answer,
                            "ok": ok,
                        }
                    ),
                    file=sys.stderr,
                    flush=True,
                )
            await reader.client.delete_session(session)
        await reader.client.close()
    total_tokens = sum(tokens)
    return {
        "bench": "larimar_passkey",
        "strategy": "larimar",
        "context_tokens": tokens[0],
        "n": n,
        "accuracy": correct / n,
        "retrieval_accuracy": found / n,
        "write_seconds": round(sum(write_s) / n, 3),
        "ingest_tokens_per_s": round(total_tokens / sum(write_s), 1),
        "read_seconds": round(sum(read_s) / n, 4),
        "generate_seconds": round(sum(gen_s) / n, 3),
        "segments_written": segments,
        "memory_slots": slots,
        "stored_bytes": stored,
        "peak_rss_mb": round(peak_rss_mb(), 1),  # process-wide, monotonic: lengths run ascending
        "peak_rss_after_load_mb": rss_after_load_mb,  # both models loaded, nothing written
        "prefix_length": params.prefix_length,
        "top_k": params.top_k,
        "misses": misses,
    }


async def main_async(args: argparse.Namespace) -> None:
    loaded = load_model(EngineConfig(device=args.device))
    params = LarimarParams(prefix_length=args.prefix_length, top_k=args.top_k)
    rng = random.Random(args.seed)
    default_embedder().embed(["Load the sentence encoder before timing."])
    rss_after_load_mb = round(peak_rss_mb(), 1)
    for length in sorted(args.lengths):
        row = await run_length(
            loaded.model,
            loaded.tokenizer,
            length,
            args.n,
            params,
            rng,
            args.new_tokens,
            args.verbose,
            rss_after_load_mb,
        )
        print(json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072, 1048576])
    parser.add_argument("-n", type=int, default=10, help="trials per length")
    parser.add_argument("--prefix-length", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="each trial's prompt on stderr")
    asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
