"""What reaches the frame for the recall bench's `relation` task: a trial's document (k facts of
one relation, as `bench recall` builds it) read into a session memory the way the server reads
an uploaded document (a user turn, chunk by chunk, the text prior attached), then each question
asked the way a session chat asks it. Per question: where the text prior ranks the asked
fact's block and the other facts' blocks, which facts' value tokens the question's retrieval
holds in the frame (at every layer, at some), the answer, and whose value the answer gives.
--task multivalue plants --facts keys of three values each (`multivalue`, a list asked once)
and says the same of every value of the asked key. No HTTP: the engine's SessionMemory
directly, so each step can be inspected. --adapter NAME (or NAME=PATH) asks through an answer
adapter as the server does (the prompt's last `lead` tokens and the answer); --rag also asks
each question the bench's RAG way (the nearest 256-token chunks by MiniLM, 3,072 tokens, in
the model's own window) and says which facts that context holds.

    python -m bench.relation_trace --length 32768 --kind manpages --trials 2 --adapter recall --rag
    python -m bench.relation_trace --length 16384 --task multivalue --facts 4 --max-tokens 48

One JSON line per question, then a summary line.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from bench.recall_corpus import build_document, chunk_document, load_token_counter, retrieve
from bench.recall_tasks import answer_budget, contains, is_correct, make_trial
from engine.config import EngineConfig
from engine.memory.config import MemorySpec
from engine.memory.session import SessionMemory
from engine.runner.adapter import AnswerAdapter, load_adapters
from engine.runner.chat_template import encode_chat, encode_document
from engine.runner.decode_state import KVCacheState
from engine.runner.loader import load_model
from engine.sessions.memory_state import MemoryState
from engine.sessions.prior_query import prior_encoder, prior_query


def _find(ids: list[int], piece: list[int]) -> int:
    """Start of the last occurrence of `piece` in `ids`, or -1."""
    n = len(piece)
    for start in range(len(ids) - n, -1, -1):
        if ids[start : start + n] == piece:
            return start
    return -1


def _value_span(tokenizer: Any, ids: list[int], value: str) -> tuple[int, int]:
    for text in (f" {value}", value):
        piece = list(tokenizer(text, add_special_tokens=False).input_ids)
        at = _find(ids, piece)
        if at >= 0:
            return at, at + len(piece)
    raise ValueError(f"value {value} not found in the document's tokens")


def _held(frame: Any, span: tuple[int, int]) -> tuple[int, int]:
    """(layers holding every token of span, layers holding some of it) at the last forward."""
    full = part = 0
    wanted = torch.arange(*span)
    for idx in frame.last_selected.values():
        positions = idx[idx >= 0] + frame.n_sinks
        held = torch.isin(wanted, positions).float().mean().item()
        full += held == 1.0
        part += 0 < held < 1.0
    return full, part


def _prior_ranks(memory: SessionMemory, spans: list[tuple[int, int]]) -> list[int]:
    """Rank (0 = nearest EmbQ) of the block holding each span's first token."""
    prior, frame = memory.prior, memory._frame
    assert prior is not None and prior._query is not None
    count = frame.n_memory // prior.block
    scores = prior.block_scores(frame)
    order = np.argsort(-scores, kind="stable")
    rank = np.empty(count, dtype=np.int64)
    rank[order] = np.arange(count)
    out = []
    for first, _ in spans:
        block = (first - frame.n_sinks) // prior.block
        out.append(int(rank[block]) if 0 <= block < count else -1)
    return out


def _answer(
    state: Any, prompt: list[int], adapter: AnswerAdapter | None, end, most: int, on_prompt=None
) -> list[int]:
    """Greedy answer as the server gives it: the prompt read by the base model, its last
    `lead` tokens and the answer through the adapter's steps when one is named."""
    lead = 0 if adapter is None else min(adapter.lead, len(prompt) - 1)
    step = state.step if adapter is None else (lambda t: adapter.step(state, t))
    with torch.inference_mode():
        logits = state.prefill(torch.tensor(prompt[: len(prompt) - lead]))
        for token in prompt[len(prompt) - lead :]:
            logits = step(token)
        if on_prompt is not None:
            on_prompt()
        answer: list[int] = []
        for _ in range(most):
            token = int(logits.argmax())
            if token in end:
                break
            answer.append(token)
            logits = step(token)
    return answer


def _with_variant(memory: SessionMemory, variant: str) -> SessionMemory:
    """memory with frame knobs changed ('k=2,prior_k=2'): config, frame, selector and prior."""
    if not variant:
        return memory
    pairs = [kv.partition("=") for kv in variant.split(",")]
    knobs: dict[str, Any] = {k: int(v) if v.isdigit() else v for k, _, v in pairs}
    config = dataclasses.replace(memory.config, **knobs)
    memory.config = memory._frame.config = config
    setattr(memory._frame.selector, "config", config)  # noqa: B010 - every selector keeps one
    if memory.prior is not None:
        memory.prior.k, memory.prior.u = config.prior_k, config.prior_u
        memory.prior.lexical = config.prior_match == "hybrid"
    return memory


def _frame_text(frame_ids, model, loaded, adapter, end, most, question):
    """The frame's own tokens (SessionMemory.frame_ids at the answer's first step) read afresh
    by the model's own attention: the frame's content without its stored keys and values."""
    state = KVCacheState(model, kv_dtype=loaded.kv_dtype)
    text = str(loaded.tokenizer.decode(_answer(state, frame_ids, adapter, end, most)))
    exact = question.task == "multivalue"
    held = str(loaded.tokenizer.decode(frame_ids))
    return {
        "frame_text_tokens": len(frame_ids),
        "frame_text_holds": sum(contains(held, v) for v in question.expected),
        "frame_text_answer": text.strip()[:160],
        "frame_text_asked_in_answer": sum(contains(text, v) for v in question.expected),
        "frame_text_correct": is_correct(text, question.expected, exact=exact),
    }


def _rag(doc, question, values, asked, model, loaded, adapter, end, most, embed) -> dict:
    """The question asked the bench's RAG way; which facts its context holds, and the answer."""
    context, _ = retrieve(doc, question.turns[0], 3072, embed)
    content = f"{context}\n\n{question.turns[0]}"
    prompt = encode_chat(loaded.tokenizer, [{"role": "user", "content": content}])
    state = KVCacheState(model, kv_dtype=loaded.kv_dtype)
    text = str(loaded.tokenizer.decode(_answer(state, prompt, adapter, end, most)))
    return {
        "rag_holds_asked": all(values[a] in context for a in asked),
        "rag_others_held": sum(v in context for j, v in enumerate(values) if j not in asked),
        "rag_answer": text.strip()[:160],
        "rag_correct": is_correct(text, question.expected, exact=question.task == "multivalue"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--kind", default="manpages")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--first-trial", type=int, default=0)
    parser.add_argument("--task", choices=("relation", "multivalue"), default="relation")
    parser.add_argument("--facts", type=int, default=8, help="relation facts, or multivalue keys")
    parser.add_argument("--strategy", default="segments")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--knob", action="append", default=[], help="memory knob k=v")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="frame knobs changed on each question's fork, e.g. 'k=2,prior_k=2' (diagnosis)",
    )
    parser.add_argument(
        "--adapter", help="ask through this answer adapter: a shipped one's name, or NAME=PATH"
    )
    parser.add_argument("--rag", action="store_true", help="also ask each question the RAG way")
    parser.add_argument(
        "--frame-text",
        action="store_true",
        help="also ask with the frame's tokens (sinks, retrieved rows) as plain text in the window",
    )
    args = parser.parse_args(argv)

    config = EngineConfig()
    loaded = load_model(config)
    tokenizer, model = loaded.tokenizer, loaded.model
    count = load_token_counter(None)
    encoder = prior_encoder(config)
    adapter = None
    if args.adapter:
        name, _, path = args.adapter.partition("=")  # a shipped name, or NAME=PATH
        adapter = load_adapters(model, "m", [args.adapter] if path else [])[f"m:{name}"]
    embed = None
    if args.rag:
        from memory_store.client import default_embedder

        embed = default_embedder().embed
    end = set(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    knobs = {k: json.loads(v) for k, _, v in (kv.partition("=") for kv in args.knob)}
    totals = {"n": 0, "correct": 0, "other_value": 0, "in_frame_all": 0, "prior_top": 0}
    totals |= {"rag_correct": 0, "rag_holds_asked": 0} if args.rag else {}
    for trial_no in range(args.first_trial, args.first_trial + args.trials):
        seed = f"{args.kind}:{trial_no}"
        if args.task == "relation":
            trial = make_trial(seed, ("relation",), facts_of_relation=args.facts)
        else:
            trial = make_trial(seed, ("multivalue",) * args.facts)
        doc = build_document(trial, args.kind, seed, args.length, 7600, count)
        ids = encode_document(tokenizer, doc.text)
        values = [v for q in trial.questions for v in q.expected]
        owner = [i for i, q in enumerate(trial.questions) for _ in q.expected]  # value -> question
        if embed is not None:
            chunk_document(doc, count, 256, embed)
        spans = [_value_span(tokenizer, ids, v) for v in values]
        spec = MemorySpec(args.strategy, knobs)
        base = SessionMemory(model, spec, loaded.kv_dtype)
        if encoder is not None:
            base.attach_prior(encoder, lambda t: str(tokenizer.decode(list(t))))
        with torch.inference_mode():
            for start in range(0, len(ids), config.prefill_chunk_tokens):
                piece = ids[start : start + config.prefill_chunk_tokens]
                base.append(torch.tensor(piece), document=True)
            base.end_document()
        history = [("user", doc.text)]
        for (i, question), variant in itertools.product(
            enumerate(trial.questions), args.variant or [""]
        ):
            messages = [{"role": "user", "content": question.turns[0]}]
            memory = _with_variant(base.fork(), variant)
            memory.set_query(prior_query(messages))
            prompt = encode_chat(tokenizer, messages, history)
            state = MemoryState(memory, args.strategy)
            asked = [a for a, q in enumerate(owner) if q == i]  # this question's values
            seen: list[list[int] | None] = []  # the frame's tokens at the answer's first step
            first: list[tuple[int, int]] = []  # each asked value's layers held at that step

            mine = tuple(spans[a] for a in asked)

            def on_prompt(m=memory, seen=seen, first=first, mine=mine) -> None:
                seen.append(m.frame_ids())
                first.extend(_held(m._frame, span) for span in mine)

            most = answer_budget(args.max_tokens, question)
            answer = _answer(state, prompt, adapter, end, most, on_prompt)
            held = [_held(memory._frame, span) for span in spans]  # the answer's last step
            with torch.inference_mode():
                ranks = _prior_ranks(memory, spans) if memory.prior is not None else []
            text = str(tokenizer.decode(answer))
            layers = len(memory._frame.last_selected) or 1
            others = sorted({owner[j] for j, v in enumerate(values) if owner[j] != i and v in text})
            record = {
                "trial": seed,
                "variant": variant,
                "q": i,
                "paraphrased": question.paraphrased,
                "depth": [round(spans[a][0] / len(ids), 3) for a in asked],
                "asked_layers_full_first_step": [f for f, _ in first],
                "asked_layers_full": [held[a][0] for a in asked],
                "asked_layers_partial": [held[a][1] for a in asked],
                "others_in_frame_all_layers": sum(
                    h[0] == layers for j, h in enumerate(held) if owner[j] != i
                ),
                "prior_rank_asked": [ranks[a] for a in asked] if ranks else None,
                "prior_ranks_others": sorted(r for j, r in enumerate(ranks) if owner[j] != i),
                "expected": list(question.expected),
                "answer": text.strip()[:160],
                "asked_in_answer": sum(contains(text, values[a]) for a in asked),
                "correct": is_correct(text, question.expected, exact=question.task == "multivalue"),
                "gave_other_fact": others,
            }
            if args.frame_text and seen and seen[0] is not None:
                record |= _frame_text(seen[0], model, loaded, adapter, end, most, question)
                totals["frame_text_correct"] = (
                    totals.get("frame_text_correct", 0) + record["frame_text_correct"]
                )
            if embed is not None and not variant:
                record |= _rag(
                    doc, question, values, asked, model, loaded, adapter, end, most, embed
                )
                totals["rag_correct"] += record["rag_correct"]
                totals["rag_holds_asked"] += record["rag_holds_asked"]
            print(json.dumps(record), flush=True)
            totals["n"] += 1
            totals["correct"] += record["correct"]
            totals["other_value"] += bool(others)
            totals["in_frame_all"] += all(held[a][0] == layers for a in asked)
            prior_k = memory.config.prior_k or 0
            totals["prior_top"] += bool(ranks) and all(ranks[a] < prior_k for a in asked)
            del memory
        del base
    print(json.dumps({"summary": totals, "kind": args.kind, "length": args.length}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
