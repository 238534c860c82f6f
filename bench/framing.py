"""How the place of a document in the conversation changes recall, with the model's own full
attention (no memory involved): the same documents, facts and questions, framed four ways.

    inline         [system][user: document + question][assistant]   (what an inline request sends)
    after-raw      [document as raw text][system][user: question][assistant]   (how a session
                   holds a document today: read as raw text, the chat turn rendered after it)
    user-turn      [system][user: document][user: question][assistant]
    system         [system: document][user: question][assistant]

Documents are sections of Python's reference manual (pydoc_data, shipped with CPython), cut to
about `--tokens` tokens, with `--facts` planted sentences at seeded random depths; each fact is
asked once, by chat, greedy. One JSON line per framing:

    python -m bench.framing --docs 5 --facts 4 --tokens 2500
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine.config import EngineConfig
from engine.runner.loader import load_model

SECTIONS = ("compound", "types", "string-methods", "typesseq", "specialnames", "execmodel")
PLACES = ("harbour", "library", "greenhouse", "observatory", "archive", "foundry", "chapel")
FRAMINGS = ("inline", "after-raw", "user-turn", "system")


def _document(section: str, tokens: int, tokenizer: Any) -> list[str]:
    import pydoc_data.topics

    text = pydoc_data.topics.topics[section]
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if len(p.split()) > 8]
    out: list[str] = []
    total = 0
    for p in paragraphs:
        n = len(tokenizer(p, add_special_tokens=False).input_ids)
        if total + n > tokens:
            break
        out.append(p)
        total += n
    return out


def _plant(paragraphs: list[str], facts: int, rng: random.Random) -> tuple[str, list[tuple]]:
    places = rng.sample(PLACES, facts)
    planted = []
    body = list(paragraphs)
    for place in places:
        code = rng.randint(100000, 999999)
        depth = rng.randrange(len(body) + 1)
        body.insert(depth, f"The access code for the {place} vault is {code}.")
        planted.append((place, code))
    return "\n\n".join(body), planted


def _ids(tokenizer: Any, framing: str, document: str, question: str) -> list[int]:
    def chat(messages: Sequence[dict[str, str]]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    if framing == "inline":
        return chat([{"role": "user", "content": f"{document}\n\n{question}"}])
    if framing == "after-raw":
        raw = list(tokenizer(document, add_special_tokens=False).input_ids)
        return raw + chat([{"role": "user", "content": question}])
    if framing == "user-turn":
        return chat([{"role": "user", "content": document}, {"role": "user", "content": question}])
    if framing == "system":
        return chat(
            [{"role": "system", "content": document}, {"role": "user", "content": question}]
        )
    raise ValueError(framing)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=5)
    parser.add_argument("--facts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--framings", nargs="+", default=list(FRAMINGS), choices=FRAMINGS)
    args = parser.parse_args(argv)

    loaded = load_model(EngineConfig())
    tokenizer, model = loaded.tokenizer, loaded.model
    rng = random.Random(args.seed)
    cases = []
    for d in range(args.docs):
        section = SECTIONS[d % len(SECTIONS)]
        document, planted = _plant(_document(section, args.tokens, tokenizer), args.facts, rng)
        cases += [(section, document, place, code) for place, code in planted]
    for framing in args.framings:
        correct, started, wrong = 0, time.perf_counter(), []
        for _section, document, place, code in cases:
            question = f"What is the access code for the {place} vault?"
            ids = torch.tensor([_ids(tokenizer, framing, document, question)])
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=24, do_sample=False)
            answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            correct += str(code) in answer
            if str(code) not in answer:
                wrong.append(answer.strip()[:60])
        record = {
            "framing": framing,
            "n": len(cases),
            "correct": correct,
            "accuracy": correct / len(cases),
            "tokens": args.tokens,
            "seconds": round(time.perf_counter() - started, 1),
            "wrong_answers": wrong[:6],
        }
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
