"""`bench recall --journal`: a run asks each document in every mode before the next, writes each
answered unit as it completes, and a later run that would send exactly the same request takes
the unit from the journal instead of asking again (no model, no server: the asking is faked)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import recall
from bench.recall_chat import Answer
from bench.recall_journal import Journal, host


def approx_tokens(texts: list[str]) -> list[int]:
    return [len(text) // 4 for text in texts]


class FakeAsker:
    model = "smol"


def make_run(tmp_path, asked: list, knobs=None, lengths=(3000,), fail=()) -> recall.Run:
    """A Run over two short held-out documents whose ask() records (length, mode, strategy) and
    answers the first question right in every mode; a mode in `fail` fails its requests."""
    args = argparse.Namespace(
        lengths=list(lengths), samples=1, n_large=None, large_from=10**9, kinds=["news", "info"],
        tasks=["relation"], keys=3, values=3, facts=4, seed=0, reserve=0, max_tokens=48,
        modes=["reference", "rag", "session"], strategies=["segments"], variants={},
        knobs=knobs or {}, kind_set="held_out", rag_tokens=500, rag_chunk_tokens=100,
    )  # fmt: skip
    run = recall.Run(args, FakeAsker(), None, {"max_model_len": 1500}, approx_tokens)
    run.journal = Journal(tmp_path / "recall.jsonl")

    def ask(mode, strategy, trial, doc):
        asked.append((len(doc.text), mode, strategy))
        error = "APIConnectionError: gone" if mode in fail else None
        answers = [
            Answer(j == 0 and error is None, 0.5, 10, "x", q.expected, error=error)
            for j, q in enumerate(trial.questions)
        ]
        if mode == "session":
            run.read_seconds[mode, strategy].append(2.0)
        return [(mode, answers)]

    run.ask = ask
    return run


def test_a_run_goes_document_by_document_and_journals_each_unit(tmp_path, capsys):
    asked: list = []
    table = recall.measure(make_run(tmp_path, asked))
    # document-major: both modes' units of the first document before the second is built
    modes = [mode for _, mode, _ in asked]
    assert modes == ["reference", "rag", "session"] * 2
    units = [json.loads(line) for line in (tmp_path / "recall.jsonl").read_text().splitlines()]
    assert [(u["kind"], u["mode"]) for u in units] == [
        ("news", "reference"), ("news", "rag"), ("news", "session"),
        ("info", "reference"), ("info", "rag"), ("info", "session"),
    ]  # fmt: skip
    assert units[2]["read_seconds"] == 2.0 and units[0]["read_seconds"] is None
    assert units[0]["host"] == host() and units[0]["rows"]["reference"][0]["question"] == "news:0:0"
    assert table["3000/session/segments"]["correct"] == 2
    assert table["3000/session/segments"]["n"] == 8


def test_a_second_run_reuses_every_unit_and_reports_the_same(tmp_path, capsys):
    first = recall.measure(make_run(tmp_path, []))
    asked: list = []
    again = make_run(tmp_path, asked)
    assert recall.measure(again) == first and asked == []
    assert again.read_seconds["session", "segments"] == [2.0, 2.0]
    provenance = again.journal.provenance()
    assert provenance["units_reused"] == 6 and provenance["units_written"] == 0
    assert provenance["hosts"] == [host()]


def test_only_units_whose_request_changed_are_asked_again(tmp_path, capsys):
    recall.measure(make_run(tmp_path, []))
    asked: list = []
    recall.measure(make_run(tmp_path, asked, knobs={"k": 4}))
    assert [mode for _, mode, _ in asked] == ["session", "session"]
    asked.clear()
    recall.measure(make_run(tmp_path, asked, lengths=(3000, 6000)))
    # the reference document is the same at every length: answered once, reused at the next
    assert [mode for _, mode, _ in asked] == ["rag", "session"] * 2


def test_failed_units_and_a_cut_last_line_are_asked_again(tmp_path, capsys):
    recall.measure(make_run(tmp_path, [], fail=("rag",)))
    path = tmp_path / "recall.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1] + [lines[-1][:40]]) + "\n")  # stopped mid-write
    asked: list = []
    recall.measure(make_run(tmp_path, asked))
    assert [(mode) for _, mode, _ in asked] == ["rag", "rag", "session"]
    assert "unreadable, ignored" in capsys.readouterr().out


def test_the_journal_flag_is_parsed(monkeypatch):
    seen = []
    monkeypatch.setattr(recall, "run", seen.append)
    recall.main(["--journal", "out.jsonl"])
    recall.main([])
    assert seen[0].journal == "out.jsonl" and seen[1].journal is None


@pytest.mark.parametrize("mode", ["reference", "truncate", "rag", "inline", "session"])
def test_every_mode_keys_on_what_it_sends(tmp_path, mode):
    from bench.recall_corpus import Document

    run = make_run(tmp_path, [])
    doc = Document(["a", "b"], 2, "ref", 1, "tail", 1)
    other = Document(["a", "c"], 2, "ref2", 1, "tail2", 1)
    sent = run.sent(mode, "segments", doc)
    assert sent != run.sent(mode, "segments", other)
    if mode in ("inline", "session"):
        run.args.knobs = {"k": 2}
        assert run.sent(mode, "segments", doc) != sent


def test_the_journal_reports_paired_rows_without_a_server(tmp_path, capsys):
    """`python -m bench.recall_journal FILE`: each length's rows over the documents every row
    answered (the reference, journaled at the first length, counts at every length)."""
    from bench.recall_journal import report

    recall.measure(make_run(tmp_path, [], lengths=(3000, 6000)))
    path = tmp_path / "recall.jsonl"
    # a run cut in the second length's second document: that document is left out of its rows
    path.write_text("\n".join(path.read_text().splitlines()[:-1]) + "\n")
    lines = report(path)
    assert lines[0].startswith("3000: 2 documents")
    assert any(line.startswith("3000 session/segments 2/8 (") for line in lines)
    assert any(line.startswith("6000 reference/- 1/4 (") for line in lines)
    assert any(line.startswith("6000 session/segments 1/4 (") for line in lines)
    assert "6000: 1 documents answered in every row" in lines
    timing = next(line for line in lines if line.startswith("6000 timing: "))
    assert "reference/- 0.5 s/question" in timing
    assert "session/segments 0.5 s/question, 2 s/read" in "\n".join(lines)
    assert "3000 multivalue (whole lists; values found; numbers invented): " in "\n".join(lines)
    assert lines[-1].startswith(f"hosts: {host()} | commits: ")


def test_list_answers_count_values_found_and_numbers_invented():
    from bench.recall_journal import list_answers

    def answer(question, text, expected, correct=False):
        return {"question": question, "text": text, "expected": expected, "correct": correct}

    unit = {
        "strategy": "segments",
        "rows": {
            "session": [
                answer("news:0:0", "1. 1234567 2. 7654321 3. 7654322", ["1234567", "7654321", "555555"]),
                answer("news:0:1", "The code is 99999.", ["99999"], correct=True),
            ]
        },
    }  # fmt: skip
    assert list_answers([unit], "session/segments", {"news:0:0"}) == (0, 1, 2, 3, 1)
    assert list_answers([unit], "inline/segments", {"news:0:0"}) == (0, 1, 0, 0, 0)
