"""Where the text prior ranks the block that holds each asked fact, with no language model.

The documents and questions are `longserve bench recall`'s (same seeds, same text kinds); the
document's tokens are cut into memory blocks, each block embedded with the engine's sentence
encoder (EmbD), and every question's EmbQ (its last paragraph, as engine/sessions/prior_query.py takes
it) ranks them. A fact whose value is cut in two by a block edge is not found (rank -1). This
separates retrieval from reading: a question the model gets wrong with its fact ranked first
failed in the model, not in the prior (docs/decisions/025-prior-rank.md).

    python -m bench.prior_rank --lengths 16384 --kinds docs manpages docstrings -n 2

One JSON line per question (rank 0 is the nearest block), then a summary per length.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import numpy as np

from bench.recall_corpus import build_document, load_token_counter
from bench.recall_tasks import MIXED_TASKS, make_trial
from engine.sessions.prior_query import question_text


def rank(embed, blocks: list[str], vectors: np.ndarray, question: str, values) -> int:
    """The rank of the best-ranked block holding one of the values, -1 if none holds one."""
    scores = vectors @ np.asarray(embed([question])[0], dtype=np.float32)
    order = np.argsort(-scores, kind="stable").tolist()
    holding = [b for b, text in enumerate(blocks) if any(v in text for v in values)]
    return min(order.index(b) for b in holding) if holding else -1


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384])
    parser.add_argument("-n", "--samples", type=int, default=2)
    parser.add_argument("--kinds", nargs="+", default=["docs", "manpages", "docstrings"])
    parser.add_argument("--block", type=int, default=64, help="memory block, in tokens")
    parser.add_argument(
        "--fit", type=int, default=8192 - 512, help="as recall's window minus --reserve"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from engine.runner.loader import embedded_model_path
    from memory_store.client import default_embedder

    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    count, embed = load_token_counter(None), default_embedder().embed
    for length in args.lengths:
        found: list[int] = []
        for kind in args.kinds:
            for i in range(args.samples):
                seed = f"{args.seed}:{kind}:{i}"
                trial = make_trial(seed, MIXED_TASKS)  # decision 025's questions
                doc = build_document(trial, kind, seed, length, args.fit, count)
                ids = tokenizer(doc.text, add_special_tokens=False).input_ids
                blocks = [
                    tokenizer.decode(ids[b : b + args.block])
                    for b in range(0, len(ids), args.block)
                ]
                vectors = np.asarray(embed(blocks), dtype=np.float32)
                for q in trial.questions:
                    # a follow-up's first turn asks for the vault, whose name is in the fact
                    first = q.task == "followup"
                    values = (q.first_expected or "",) if first else q.expected
                    text = question_text(q.turns[0] if first else q.turns[-1])
                    found.append(rank(embed, blocks, vectors, text, values))
                    line = {"length": length, "kind": kind, "trial": i, "task": q.task}
                    print(json.dumps({**line, "rank": found[-1], "blocks": len(blocks)}))
        ok = np.array([r for r in found if r >= 0])
        summary = {
            "length": length,
            "questions": len(found),
            "split_by_a_block_edge": len(found) - ok.size,
            "rank_0": int((ok == 0).sum()),
            "rank_below_8": int((ok < 8).sum()),
            "median_rank": float(np.median(ok)) if ok.size else None,
            "max_rank": int(ok.max()) if ok.size else None,
        }
        print(json.dumps({"bench": "prior_rank", **summary}))


if __name__ == "__main__":
    main()
