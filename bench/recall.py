"""Recall of facts planted in long documents of real text, asked through the chat API.

Documents come from kinds of text installed on this machine (bench/recall_corpus.py): the
tuned kinds by default, the held-out kinds with --held-out (never both in one run). Facts and
questions are those of bench/recall_tasks.py: by default the `relation` task, --facts facts of
one relation per document, each asked, half of them paraphrased; the earlier mix (single,
multikey, multivalue, paraphrase, followup) with --tasks. Enough trials run per length and kind
for --questions questions per mode and length. Each question goes through the official openai
SDK's `chat.completions.create`, greedy, as a user asks it: the question alone, no answer prefix.
The same facts and the same question wording are asked in every mode of one run:

- `reference`: the model's own full attention: a document of the same kind and seed that fits
  the window (the opening of the long one's text) with the same facts at the same depths;
- `truncate`: the long document's last paragraphs that fit the window, in a plain request;
- `rag`: the long document cut into chunks of about --rag-chunk-tokens; all-MiniLM-L6-v2
  picks the chunks nearest the question (with the previous answer, on a follow-up turn) up to
  --rag-tokens, sent in document order in a plain request;
- `inline`: the whole long document in the user message (the server reads it into ephemeral
  memory), per strategy;
- `session`: the document uploaded once per (trial, strategy) to a session, each question in
  its own chat with `session_id`. A chat that does not continue the conversation held starts
  again from the end of the documents (docs/api.md, Turns), so no question sees another's
  answer; a follow-up's two turns are one chat.

Starts `longserve serve` on a free loopback port (or drives --base-url on loopback). One JSON
line per cell (length, kind or "all", task, mode, strategy) as soon as it is complete, then a
summary line per length and mode (correct/n, Wilson 95 % interval, McNemar's exact p against
each other mode on the same questions: bench/recall_report.py), then one summary line for the
run. Token counts are the model's tokenizer's (loaded from the same GGUF):

    longserve bench recall --lengths 32768 --held-out --strategies segments

--memory-dtypes measures every inline and session cell of a strategy that holds memory blocks
once per `memory_dtype`, as a strategy of its own (`segments@int8`): the same documents and
questions, so the summary pairs them (McNemar), e.g. float16 against int8 in one run:

    longserve bench recall --lengths 32768 --held-out --strategies segments --modes session \
        --memory-dtypes float16 int8

--variants NAME=JSON does the same with named memory knobs (`segments@hybrid`), e.g. the text
prior's two matches in one run: `--variants dense='{"prior_match": "dense"}'
hybrid='{"prior_match": "hybrid"}'`.

--journal FILE appends each answered unit (one document in one mode) to FILE as it completes and
reuses the units an earlier run answered with exactly the same request (bench/recall_journal.py):
documents are asked one at a time in every mode, so a run stopped early still pairs, and the same
command run again goes on where it stopped:

    longserve bench recall --lengths 32768 131072 --held-out --strategies segments \
        --modes reference truncate rag session inline --journal recall.jsonl

--adapter NAME asks every question of every mode a second time through the answer adapter
served as `<model>:NAME` (engine/runner/adapter.py), on the same session or context, as the
rows `mode+NAME`: the adapter against the base model on the same questions, in one run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np

from bench.recall_args import BASELINES, FRAMELESS, MEMORY_MODES, STRATEGIES, parse_args
from bench.recall_chat import Answer, Asker, ask_all, upload
from bench.recall_corpus import (
    Document,
    build_document,
    chunk_document,
    digest,
    load_token_counter,
    retrieve,
)
from bench.recall_journal import Journal, unit_key
from bench.recall_report import cell_record, compare_rows, row_text
from bench.recall_tasks import Trial, make_trial
from bench.server_process import model_args, served


@dataclass
class Run:
    """What one run shares: the server, the documents and the cells measured so far."""

    args: argparse.Namespace
    asker: Asker
    http: httpx.Client
    info: dict
    count: Callable[[list[str]], list[int]]
    embed: Callable[[list[str]], np.ndarray] | None = None
    # --adapter: the same questions through each adapter's model id, by adapter name
    adapted: dict[str, Asker] = field(default_factory=dict)
    cells: dict[tuple, list[Answer]] = field(default_factory=lambda: defaultdict(list))
    read_seconds: dict[tuple, list[float]] = field(default_factory=lambda: defaultdict(list))
    journal: Journal | None = None  # --journal: units answered before, reused when identical

    def ask(
        self, mode: str, strategy: str | None, trial: Trial, doc: Document
    ) -> list[tuple[str, list[Answer]]]:
        """(mode, answers): the base model's, then with --adapter the adapter's ("mode+name"),
        asked on the same session or the same context."""
        askers = [(mode, self.asker)]
        askers += [(f"{mode}+{name}", asker) for name, asker in self.adapted.items()]
        if mode != "session":
            return [(name, self._ask(asker, mode, strategy, trial, doc)) for name, asker in askers]
        memory = self._memory(strategy)
        session_id, tokens, seconds = upload(self.http, memory, doc.text, 3600)
        try:
            out = [
                (name, ask_all(asker, trial, lambda *_: None, {"session_id": session_id}))
                for name, asker in askers
            ]
        finally:
            self.http.delete(f"/sessions/{session_id}")
        for _, answers in out:
            for answer in answers:
                answer.context_tokens = tokens
        self.read_seconds[mode, strategy].append(seconds)
        return out

    def ask_unit(
        self, mode: str, strategy: str | None, trial: Trial, doc: Document, where: dict
    ) -> list[tuple[str, list[Answer]]]:
        """ask(), with each answer named by question (kind:trial:index, the same in every mode),
        taken from --journal when an earlier run sent exactly this, else asked and journaled."""
        key = None
        if self.journal is not None:
            sent = self.sent(mode, strategy, doc)
            model, budget = self.asker.model, self.args.max_tokens
            key = unit_key(row_name(mode, strategy), sent, trial, model, budget)
            found = self.journal.get(key)
            if found is not None:
                rows, seconds = found
                if seconds is not None:
                    self.read_seconds[mode, strategy].append(seconds)
                self._progress(where, rows, "journal")
                return list(rows.items())
        out = self.ask(mode, strategy, trial, doc)
        for _, answers in out:
            for j, (question, answer) in enumerate(zip(trial.questions, answers, strict=True)):
                answer.question = f"{where['kind']}:{where['trial']}:{j}"
                answer.paraphrased = question.paraphrased
        if key is not None:  # set only with a journal
            assert self.journal is not None
            reads = self.read_seconds.get((mode, strategy)) if mode == "session" else None
            self.journal.put(key, where, dict(out), reads[-1] if reads else None)
        self._progress(where, dict(out), "asked")
        return out

    def sent(self, mode: str, strategy: str | None, doc: Document) -> dict:
        """What a mode sends the server besides the questions (texts by sha256): a journal
        unit's key (bench/recall_journal.py)."""

        def sha(text: str) -> str:
            return hashlib.sha256(text.encode()).hexdigest()

        if mode == "reference":
            body: dict = {"text": sha(doc.reference)}
        elif mode == "truncate":
            body = {"text": sha(doc.tail)}
        elif mode == "rag":
            args = self.args
            body = {"text": sha(doc.text), "rag": [args.rag_tokens, args.rag_chunk_tokens]}
        else:
            body = {"text": sha(doc.text), "memory": self._memory(strategy)}
        return {**body, "adapters": sorted(self.adapted)}

    @staticmethod
    def _progress(where: dict, rows: dict[str, list[Answer]], source: str) -> None:
        for row, answers in rows.items():
            right = sum(a.correct for a in answers)
            print(
                f"{where['length']} {where['kind']}:{where['trial']} {row}/"
                f"{where['strategy'] or '-'} {right}/{len(answers)} ({source})",
                file=sys.stderr,
                flush=True,
            )

    def _memory(self, strategy: str | None) -> dict:
        name, _, variant = (strategy or "").partition("@")  # combos: "segments@int8"
        return {"strategy": name, **self.args.knobs, **self.args.variants.get(variant, {})}

    def _ask(
        self, asker: Asker, mode: str, strategy: str | None, trial: Trial, doc: Document
    ) -> list[Answer]:
        budget = self.args.rag_tokens

        def first(context: str, tokens: int):
            return lambda turn, _q, _prev: (context, tokens) if turn == 0 else None

        if mode == "reference":
            return ask_all(asker, trial, first(doc.reference, doc.reference_tokens), {})
        if mode == "truncate":
            return ask_all(asker, trial, first(doc.tail, doc.tail_tokens), {})
        if mode == "rag":
            if doc.chunk_vectors is None:
                chunk_document(doc, self.count, self.args.rag_chunk_tokens, self.rag_embedder())
            embed = self.rag_embedder()
            return ask_all(
                asker,
                trial,
                lambda _turn, q, prev: retrieve(doc, f"{prev}\n{q}".strip(), budget, embed),
                {},
            )
        memory = self._memory(strategy)
        return ask_all(asker, trial, first(doc.text, doc.tokens), {"memory": memory})

    def rows(self, mode: str) -> list[str]:
        """The rows a mode's cells fill: its own, and with --adapter the adapter's."""
        return [mode] + [f"{mode}+{name}" for name in self.adapted]

    def rag_embedder(self) -> Callable[[list[str]], np.ndarray]:
        if self.embed is None:
            from memory_store.client import default_embedder

            self.embed = default_embedder().embed
        return self.embed

    def line(self, length: int, kind: str, task: str, mode: str, strategy, answers) -> dict:
        reads = self.read_seconds.get((mode, strategy))
        return cell_record(length, kind, task, mode, strategy, answers, self.info, reads)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def combos(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(mode, strategy) of every cell; with --memory-dtypes or --variants a strategy with
    memory blocks runs once per dtype or variant, named "strategy@dtype" ("strategy@name")."""
    out: list[tuple[str, str | None]] = [(m, None) for m in args.modes if m in BASELINES]
    for strategy in args.strategies:
        variants = list(args.variants) if strategy not in FRAMELESS else None
        names = [f"{strategy}@{v}" for v in variants] if variants else [strategy]
        out += [(m, name) for name in names for m in args.modes if m in MEMORY_MODES]
    return out


def trials_per_kind(args: argparse.Namespace, length: int) -> int:
    """-n (or --n-large from --large-from up) when given, else enough trials for --questions
    questions per mode at this length over all --kinds."""
    given = args.n_large if length >= args.large_from and args.n_large else args.samples
    if given:
        return given
    asked = make_trial("count", tuple(args.tasks), args.keys, args.values, args.facts).questions
    return math.ceil(args.questions / (len(asked) * len(args.kinds)))


def row_name(mode: str, strategy: str | None) -> str:
    return f"{mode}/{strategy or '-'}"


def compare_length(run: Run, length: int) -> dict[str, dict]:
    """The rows of one length (row_name -> n, interval, McNemar against the others), each also
    emitted as a summary line, with the questions it got right, to pair with another run's."""
    rows: dict[str, dict[str, bool]] = defaultdict(dict)
    for (at, _kind, _task, mode, strategy), answers in run.cells.items():
        if at == length:
            rows[row_name(mode, strategy)].update((a.question, a.correct) for a in answers)
    table = compare_rows(rows)
    kind_set = run.args.kind_set
    for name, row in table.items():
        text = row_text(length, name, row)
        print(text, file=sys.stderr, flush=True)
        right = sorted(q for q, correct in rows[name].items() if correct)
        emit(
            {
                "bench": "recall",
                "length": length,
                "row": name,
                "kind_set": kind_set,
                **row,
                "questions_right": right,
            }
        )
    return table


def measure(run: Run) -> dict[str, dict]:
    """Document-major: each document is asked in every mode and strategy before the next is
    built, so a run stopped early (or continued from --journal) still pairs its rows."""
    args = run.args
    fit = run.info["max_model_len"] - args.reserve
    table: dict[str, dict] = {}
    for length in args.lengths:
        trials = trials_per_kind(args, length)
        for mode, strategy in combos(args):
            run.read_seconds.pop((mode, strategy), None)
        for kind in args.kinds:
            for i in range(trials):
                seed = f"{args.seed}:{kind}:{i}"
                trial = make_trial(seed, tuple(args.tasks), args.keys, args.values, args.facts)
                doc = build_document(trial, kind, seed, length, fit, run.count)
                document = digest(doc.text)
                emit({"bench": "recall", "length": length, "kind": kind, "trial": i,
                      "document": document})  # fmt: skip
                for mode, strategy in combos(args):
                    where = {"length": length, "kind": kind, "trial": i, "mode": mode,
                             "strategy": strategy, "document": document}  # fmt: skip
                    for row, answers in run.ask_unit(mode, strategy, trial, doc, where):
                        for question, answer in zip(trial.questions, answers, strict=True):
                            run.cells[length, kind, question.task, row, strategy].append(answer)
        for mode, strategy in combos(args):
            for task in args.tasks:
                for row in run.rows(mode):
                    for kind in args.kinds:
                        answers = run.cells[length, kind, task, row, strategy]
                        emit(run.line(length, kind, task, row, strategy, answers))
                    answers = [
                        a
                        for kind in args.kinds
                        for a in run.cells[length, kind, task, row, strategy]
                    ]
                    line = run.line(length, "all", task, row, strategy, answers)
                    line["questions_right"] = sorted(a.question for a in answers if a.correct)
                    emit(line)
        for name, row in compare_length(run, length).items():
            table[f"{length}/{name}"] = row
    return table


def summary(run: Run, table: dict[str, dict], seconds: float) -> dict:
    args = {k: v for k, v in vars(run.args).items() if k not in ("api_key",)}
    return {
        "bench": "recall",
        "kind_set": run.args.kind_set,
        "summary": table,
        "seconds": round(seconds),
        "args": args,
        **run.info,
    }


def run(args: argparse.Namespace) -> None:
    import openai

    started = time.perf_counter()
    count = load_token_counter(args.model)
    serving = served(
        args.base_url,
        serve_args=model_args(args) + [f"--adapter={a}" for a in args.serve_adapter or ()],
        ready_timeout=args.ready_timeout,
        prefix="longserve-recall-",
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        stdout=sys.stderr,
    )
    with serving as base:
        client = openai.OpenAI(
            base_url=f"{base}/v1", api_key=args.api_key, timeout=3600, max_retries=0
        )
        card = client.models.list().data[0]
        extra = card.model_extra or {}
        info = {"model": card.id, "max_model_len": extra.get("max_model_len")}
        missing = set(args.strategies) - set(extra.get("strategies") or STRATEGIES)
        if missing:
            raise SystemExit(f"the server does not offer {sorted(missing)}")
        headers = {"Authorization": f"Bearer {args.api_key}"}
        with httpx.Client(base_url=f"{base}/v1", headers=headers, timeout=600) as http:
            bench = Run(args, Asker(client, card.id, args.max_tokens), http, info, count)
            bench.journal = Journal(args.journal) if args.journal else None
            served_ids = [m.id for m in client.models.list().data]
            for adapter in args.adapter or ():
                name = f"{card.id}:{adapter}"
                if name not in served_ids:
                    raise SystemExit(f"the server does not serve {name} (it serves {served_ids})")
                bench.adapted[adapter] = Asker(client, name, args.max_tokens)
            table = measure(bench)
            record = summary(bench, table, time.perf_counter() - started)
            if bench.journal is not None:
                record["provenance"] = bench.journal.provenance()
            emit(record)


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv, __doc__.split("\n\n")[0]))


if __name__ == "__main__":
    main()
