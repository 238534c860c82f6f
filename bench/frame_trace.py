"""What reaches the frame: for facts planted in a long document read into a session memory,
whether the question's retrieval brings each fact's tokens into the frame, layer by layer, and
what the model answers with them - for the question framed as a session asks it today (a chat
turn rendered after the document: "session"), as an inline request frames it (the document
inside the user turn: "inline"), and with the document as a user turn of its own after the
system prompt, the question the next user turn ("user-turn", how a session frames it since
docs/decisions/021); --prior adds the text prior (decisions/022). No HTTP: the engine's SessionMemory directly, so each step can be inspected.

    python -m bench.frame_trace --tokens 12000 --facts 4 --strategy segments

One JSON line per fact and framing: fact depth, the layers whose retrieval held every token of
the fact sentence (and how many held part of it), the answer, and whether it was right.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from typing import Any

import torch

from bench.framing import PLACES, SECTIONS
from engine.config import EngineConfig
from engine.memory.config import MemorySpec
from engine.memory.session import SessionMemory
from engine.runner.loader import load_model


def _paragraphs() -> list[str]:
    import pydoc_data.topics

    out = []
    for section in SECTIONS:
        text = pydoc_data.topics.topics[section]
        out += [" ".join(p.split()) for p in text.split("\n\n") if len(p.split()) > 8]
    return out


def _document(tokenizer: Any, tokens: int, facts: int, rng: random.Random) -> tuple[list, list]:
    """Token ids of a document of about `tokens` tokens and, per fact, (place, code, span)."""
    paragraphs = _paragraphs()
    planted = [(p, rng.randint(100000, 999999)) for p in rng.sample(PLACES, facts)]
    depths = sorted(rng.uniform(0.05, 0.95) for _ in planted)
    ids: list[int] = []
    spans = []
    pending = list(zip(depths, planted, strict=True))
    for paragraph in paragraphs:
        while pending and len(ids) >= pending[0][0] * tokens:
            _, (place, code) = pending.pop(0)
            sentence = f"The access code for the {place} vault is {code}."
            piece = tokenizer(sentence + "\n\n", add_special_tokens=False).input_ids
            spans.append((place, code, (len(ids), len(ids) + len(piece) - 1)))
            ids += piece
        ids += tokenizer(paragraph + "\n\n", add_special_tokens=False).input_ids
        if len(ids) >= tokens:
            break
    return ids, spans


def _question(tokenizer: Any, place: str, framing: str) -> list[int]:
    question = f"What is the access code for the {place} vault?"
    if framing == "session":  # today: the chat turn rendered after the raw document
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    if framing == "user-turn":  # the document was a user turn of its own; the question is the next
        text = f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    else:  # inline's ending: the document sits inside the user turn, the question closes it
        text = f"\n\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _opening(tokenizer: Any, framing: str) -> list[int]:
    if framing == "session":
        return []
    messages = [{"role": "user", "content": "\ue000"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return list(tokenizer(text.split("\ue000")[0], add_special_tokens=False).input_ids)


def _trace(memory: SessionMemory, first: int, last: int) -> dict[str, Any]:
    frame = memory._frame
    full, part = [], 0
    for layer, idx in sorted(frame.last_selected.items()):
        positions = idx[idx >= 0] + frame.n_sinks  # memory rows -> session positions
        held = torch.isin(torch.arange(first, last), positions).float().mean().item()
        if held == 1.0:
            full.append(layer)
        elif held > 0:
            part += 1
    in_window = frame.num_tokens - frame.n_local <= first
    return {"layers_full": full, "layers_partial": part, "in_window": in_window}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=12000)
    parser.add_argument("--facts", type=int, default=4)
    parser.add_argument("--docs", type=int, default=1)
    parser.add_argument("--strategy", default="segments")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--framings", nargs="+", default=["session", "inline", "user-turn"])
    parser.add_argument(
        "--prior", action="store_true", help="with the text prior (engine/memory/prior.py)"
    )
    args = parser.parse_args(argv)

    loaded = load_model(EngineConfig())
    tokenizer, model = loaded.tokenizer, loaded.model
    rng = random.Random(args.seed)
    end = set(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    for d in range(args.docs):
        ids, spans = _document(tokenizer, args.tokens, args.facts, rng)
        for framing in args.framings:
            base = SessionMemory(model, MemorySpec(strategy=args.strategy))
            if args.prior:
                from memory_store.client import default_embedder

                base.attach_prior(default_embedder(), lambda t: tokenizer.decode(list(t)))
            opening = _opening(tokenizer, framing)
            base.append(torch.tensor(opening + ids), document=True)
            for place, code, (first, last) in spans:
                memory = base.fork()
                memory.set_query(f"What is the access code for the {place} vault?")
                logits = memory.append(torch.tensor(_question(tokenizer, place, framing)))
                shift = len(opening)
                trace = _trace(memory, first + shift, last + shift)
                answer = []
                for _ in range(16):
                    token = int(logits.argmax())
                    if token in end:
                        break
                    answer.append(token)
                    logits = memory.append(torch.tensor([token]))
                text = tokenizer.decode(answer)
                record = {
                    "doc": d,
                    "framing": framing,
                    "strategy": args.strategy,
                    "tokens": len(ids),
                    "depth": round(first / len(ids), 3),
                    **trace,
                    "answer": text.strip()[:60],
                    "correct": str(code) in text,
                    "prior": args.prior,
                }
                print(json.dumps(record), flush=True)
                del memory
            del base
    return 0


if __name__ == "__main__":
    sys.exit(main())
