"""bench/recall's documents, facts, questions and scoring (no model, no server): documents of
real text that are the same for a seed, held-out kinds apart from the tuned ones, facts where
they were meant to go, paraphrases that do not repeat the fact's words, and the scoring,
interval and paired test the JSON lines report."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from bench import recall
from bench.recall_chat import Answer
from bench.recall_corpus import (
    DEFAULT_HELD_OUT,
    HELD_OUT_KINDS,
    SOURCES,
    TUNED_KINDS,
    Document,
    build_document,
    doc_files,
    filler,
    man_pages,
    prose_paragraphs,
    read_docstrings,
    retrieve,
)
from bench.recall_report import compare_rows, mcnemar_exact, paired, row_text
from bench.recall_tasks import (
    FOLLOWUP_QUESTION,
    RELATIONS,
    TOKENS_PER_LISTED_VALUE,
    VAULT,
    Question,
    answer_budget,
    contains,
    is_correct,
    make_trial,
    plant_facts,
    wilson,
)

STOPWORDS = set(
    [
        "the",
        "a",
        "an",
        "of",
        "is",
        "was",
        "what",
        "which",
        "how",
        "many",
        "does",
        "do",
        "in",
        "on",
        "with",
        "to",
        "for",
        "and",
        "by",
        "has",
        "have",
        "one",
        "are",
        "its",
        "it",
    ]
)


def approx_tokens(texts: list[str]) -> list[int]:
    return [len(text) // 4 for text in texts]


def content_stems(sentence: str) -> set[str]:
    """Words that carry meaning, cut to five letters so "register" meets "registration"."""
    words = re.findall(r"[a-z]+", sentence.lower())
    return {word[:5] for word in words if word not in STOPWORDS and word not in ("key", "value")}


# man pages are tested where the machine has them (a man binary and pages to render), and the
# held-out kinds where it has their files
KINDS = ["docs", "docstrings"] + (["manpages"] if shutil.which("man") and man_pages() else [])
HELD_OUT = [kind for kind in HELD_OUT_KINDS if SOURCES[kind][0]()]


@pytest.fixture
def stdlib_docstrings(monkeypatch):
    """The docstrings kind over the standard library's top-level modules only: the same reader,
    without walking every installed package (seconds)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    modules = tuple(sorted(str(path) for path in root.glob("*.py")))
    monkeypatch.setitem(SOURCES, "docstrings", (lambda: modules, read_docstrings))


@pytest.mark.parametrize("kind", KINDS + HELD_OUT)
def test_documents_are_real_prose_the_same_for_a_seed(kind, stdlib_docstrings):
    first = [p for p, _ in filler(kind, 7, 2000, approx_tokens)]
    assert [p for p, _ in filler(kind, 7, 2000, approx_tokens)] == first
    shorter = [p for p, _ in filler(kind, 8, 1000, approx_tokens)]
    assert shorter != first[: len(shorter)]
    assert 1500 <= sum(approx_tokens(first)) + 2 * len(first) <= 2000
    # a shorter document of the same seed is the opening of the longer one
    shorter = [p for p, _ in filler(kind, 7, 1000, approx_tokens)]
    assert shorter == first[: len(shorter)]
    # (list items such as "1." are not sentences)
    sentences = [s for p in first for s in re.split(r"(?<=\.)\s+", p) if len(s) > 3]
    assert len(set(sentences)) >= 0.95 * len(sentences), "filler repeats its sentences"
    assert not any(re.search(r"\d{5,}", p) for p in first)


def test_prose_paragraphs_drop_code_tables_and_long_numbers():
    prose = (
        "The library keeps its books on open shelves, so that readers may browse before they "
        "borrow. Each shelf is labelled by subject, and the labels follow the same order in "
        "every room of the building, which makes a visit to any branch feel familiar."
    )
    code = "def f(x):\n    return {x: [x * 2 for _ in range(3)]} | {'a': 1}  # " + "x = y; " * 30
    table = "| a | b |\n| --- | --- |\n" + "| 1 | 2 |\n" * 40
    numbered = prose.replace("open shelves", "shelf 1234567")
    text = "\n\n".join([prose, code, table, numbered, "Too short."])
    assert prose_paragraphs(text) == [prose]


def test_facts_land_at_their_depths():
    trial = make_trial(3)
    paragraphs = [f"Paragraph number {i} of the filler." for i in range(400)]
    planted = plant_facts(paragraphs, trial.facts)
    assert len(planted) == len(paragraphs) + len(trial.facts)
    for fact in trial.facts:
        at = planted.index(fact.sentence)
        before = sum(1 for p in planted[:at] if p.startswith("Paragraph number"))
        assert abs(before / len(paragraphs) - fact.depth) <= 1 / len(paragraphs) + 1e-9


def test_a_trial_is_the_same_for_a_seed_and_its_answers_are_planted():
    trial = make_trial(11)
    assert make_trial(11) == trial
    assert make_trial(12) != trial
    assert [q.task for q in trial.questions] == ["single", "multikey", "multikey", "multikey"] + [
        "multivalue",
        "paraphrase",
        "followup",
    ]
    sentences = " ".join(f.sentence for f in trial.facts)
    values = [v for q in trial.questions for v in q.expected]
    assert len(set(values)) == len(values)
    for value in values:
        assert re.fullmatch(r"\d{5,7}", value) and sentences.count(value) == 1
    assert len({f.depth for f in trial.facts}) == len(trial.facts)
    multivalue = next(q for q in trial.questions if q.task == "multivalue")
    assert len(multivalue.expected) == 3


def test_the_follow_up_needs_the_first_answer():
    question = next(q for q in make_trial(5).questions if q.task == "followup")
    vault = question.first_expected
    assert vault not in question.turns[1] and question.turns[1] == FOLLOWUP_QUESTION
    facts = [f.sentence for f in make_trial(5).facts]
    code_facts = [f for f in facts if question.expected[0] in f]
    assert len(code_facts) == 1 and vault in code_facts[0]
    # another vault with its own keeper and code: guessing the vault does not answer it
    assert sum("vault" in f for f in facts) == 4


@pytest.mark.parametrize("name", list(RELATIONS) + ["vault"])
def test_paraphrases_share_no_content_word_with_the_fact(name):
    relation = RELATIONS.get(name, VAULT)
    forms = set().union(*(content_stems(form) for form in relation.facts))
    assert content_stems(relation.paraphrase) & forms == set()
    assert len(content_stems(relation.question) & forms) >= 2  # the literal one repeats them


def test_scoring_finds_the_value_and_nothing_like_it():
    assert contains("The access code is 1,234,567.", "1234567")
    assert contains("It is 48213", "48213")
    assert not contains("It is 482135", "48213")
    assert not contains("It is 148213", "48213")
    assert contains("The vault is the quinmar vault.", "Quinmar")
    assert is_correct("codes: 11111, 22222 and 33333", ("11111", "22222", "33333"))
    assert not is_correct("codes: 11111 and 33333", ("11111", "22222", "33333"))


def test_a_list_is_judged_whole_and_given_room_for_each_value():
    """multivalue: every value, no invented one beside them (a number of a value's size),
    and an answer budget that grows with the values to list."""
    three = ("4018591", "6676506", "4950751")
    listed = "The badges are:\n\n1. 4018591\n2. 6676506\n3. 4950751"
    assert is_correct(listed, three, exact=True)
    assert is_correct(listed + "\n4. 4018591", three, exact=True)  # a value said twice
    assert not is_correct(listed + "\n4. 6676507", three, exact=True)
    assert is_correct(listed + "\n4. 6676507", three)  # one fact asked: extra text is fine
    assert is_correct("Issued in 2019: 1. 4018591 2. 6676506 3. 4950751", three, exact=True)
    question = Question("multivalue", ("Which badges?",), three)
    assert answer_budget(48, question) == 48 + 2 * TOKENS_PER_LISTED_VALUE
    assert answer_budget(48, Question("relation", ("What?",), ("4018591",))) == 48


def test_wilson_interval():
    assert wilson(0, 0) == (0.0, 1.0)
    low, high = wilson(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-4) and high == pytest.approx(0.7634, abs=1e-4)
    low, high = wilson(10, 10)
    assert low == pytest.approx(0.7225, abs=1e-4) and high == 1.0
    assert wilson(0, 10)[0] == 0.0


def test_rag_keeps_the_nearest_chunks_in_document_order_within_budget():
    vectors = np.eye(4, dtype=np.float32)
    doc = Document(["a", "b", "c", "d"], 4, "", 0, "", 0)
    doc.chunks, doc.chunk_tokens = ["A", "B", "C", "D"], [100, 100, 250, 100]
    doc.chunk_vectors = vectors

    def embed(_texts):
        return np.array([[0.1, 0.2, 0.9, 0.8]], dtype=np.float32)

    assert retrieve(doc, "q", 350, embed) == ("C\n\nD", 350)
    assert retrieve(doc, "q", 300, embed) == ("C", 250)
    assert retrieve(doc, "q", 200, embed) == ("B\n\nD", 200)  # C is nearest but too large


def test_prior_rank_finds_the_best_ranked_block_that_holds_the_value():
    from bench.prior_rank import rank

    blocks = ["filler one", "code 12345 here", "filler two", "also 12345"]
    table = {"filler one": [1, 0], "code 12345 here": [0, 1], "filler two": [0.9, 0.1]}
    table["also 12345"] = [0.5, 0.5]
    table["which code?"] = [1, 0]  # nearest the fillers: the value's blocks rank 2 and 3

    def embed(texts):
        return np.array([table[t] for t in texts], dtype=np.float32)

    vectors = embed(blocks)
    assert rank(embed, blocks, vectors, "which code?", ("12345",)) == 2
    assert rank(embed, blocks, vectors, "which code?", ("999",)) == -1


def test_held_out_kinds_share_no_file_with_the_tuned_ones():
    assert set(TUNED_KINDS).isdisjoint(HELD_OUT_KINDS)
    assert set(DEFAULT_HELD_OUT) <= set(HELD_OUT_KINDS)
    held_out = set().union(*(SOURCES[kind][0]() for kind in HELD_OUT_KINDS))
    assert held_out.isdisjoint(doc_files())


@pytest.mark.parametrize("kind", HELD_OUT)
def test_a_held_out_document_has_the_asked_length_and_is_the_same_for_a_seed(kind):
    trial = make_trial("held", ("relation",))
    doc = build_document(trial, kind, "held", 8000, 2000, approx_tokens)
    again = build_document(trial, kind, "held", 8000, 2000, approx_tokens)
    assert again.text == doc.text and again.reference == doc.reference
    assert 7000 <= doc.tokens <= 8000 and doc.reference_tokens <= 2000
    for fact in trial.facts:
        assert doc.text.count(fact.sentence) == 1 and doc.reference.count(fact.sentence) == 1
    assert build_document(trial, kind, "other", 8000, 2000, approx_tokens).text != doc.text


@pytest.mark.parametrize("facts", [4, 8])
def test_a_relation_trial_asks_every_fact_of_one_relation_spread_over_the_document(facts):
    trial = make_trial(21, ("relation",), facts_of_relation=facts)
    assert make_trial(21, ("relation",), facts_of_relation=facts) == trial
    assert len(trial.facts) == len(trial.questions) == facts
    values = [q.expected[0] for q in trial.questions]
    assert len(set(values)) == facts and len({f.sentence for f in trial.facts}) == facts
    # every fact asked: each value is in exactly one fact, each fact's value is asked
    for fact in trial.facts:
        assert sum(value in fact.sentence for value in values) == 1
    # one relation: every fact is one of its sentence forms, every question one of its two
    relation = next(
        r
        for r in [*RELATIONS.values(), VAULT]
        if all(any(_fits(form, f.sentence) for form in r.facts) for f in trial.facts)
    )
    for q in trial.questions:
        assert _fits(relation.paraphrase if q.paraphrased else relation.question, q.turns[0])
    assert sum(q.paraphrased for q in trial.questions) == facts // 2
    # depths spread: one fact in each 1/facts of the document
    assert sorted(int(f.depth * facts) for f in trial.facts) == list(range(facts))


def test_relation_trials_draw_every_relation_and_leave_the_follow_up_its_vaults():
    drawn = {make_trial(seed, ("relation",)).facts[0].sentence.split()[-2] for seed in range(60)}
    assert len(drawn) >= 4  # not always the same relation
    for seed in range(20):
        trial = make_trial(seed, ("relation", "followup"), facts_of_relation=4)
        code_facts = [
            f for f in trial.facts if "vault" in f.sentence and any(c.isdigit() for c in f.sentence)
        ]
        assert len(code_facts) == 2  # only the follow-up's two vaults have codes


def _fits(form: str, sentence: str) -> bool:
    pattern = re.escape(form).replace(r"\{key\}", r"[A-Z][a-z]+").replace(r"\{value\}", r"\d+")
    return re.fullmatch(pattern, sentence) is not None


def test_mcnemar_exact_test_against_known_values():
    # 2 * P(X <= min) for X ~ Binomial(n, 1/2), n the discordant pairs
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(0, 5) == 2 / 32
    assert mcnemar_exact(1, 9) == mcnemar_exact(9, 1) == 2 * 11 / 1024
    assert mcnemar_exact(2, 8) == pytest.approx(0.109375)
    assert mcnemar_exact(10, 25) == pytest.approx(0.0166738478, rel=1e-8)  # scipy binomtest
    assert mcnemar_exact(0, 6) < 0.05 < mcnemar_exact(1, 6)
    assert mcnemar_exact(4, 5) == 1.0  # the two-sided tail passes 1 and is cut there


def test_modes_are_compared_question_for_question():
    a = {"q1": True, "q2": True, "q3": False, "q4": True, "q5": False}
    b = {"q1": True, "q2": False, "q3": True, "q4": False, "q5": False, "only-b": True}
    assert paired(a, b) == (2, 1, 5)
    table = compare_rows({"reference": b, "session/segments": a})
    row = table["session/segments"]
    assert (row["n"], row["correct"]) == (5, 3)
    assert (row["ci_low"], row["ci_high"]) == tuple(round(x, 4) for x in wilson(3, 5))
    assert row["vs"]["reference"] == {"won": 2, "lost": 1, "pairs": 5, "p": 1.0}
    assert table["reference"]["vs"]["session/segments"]["won"] == 1
    line = row_text(32768, "session/segments", row)
    assert line.startswith("32768 session/segments 3/5 (") and "vs reference +2 -1 p=1" in line


def test_the_defaults_ask_at_least_56_questions_per_mode_and_length(monkeypatch):
    seen = []
    monkeypatch.setattr(recall, "run", seen.append)
    recall.main([])
    recall.main(["--held-out"])
    recall.main(["--held-out", "--kinds", "licenses", "-n", "2"])
    tuned, held_out, named = seen
    assert (tuned.kinds, tuned.kind_set) == (list(TUNED_KINDS), "tuned")
    assert (held_out.kinds, held_out.kind_set) == (list(DEFAULT_HELD_OUT), "held_out")
    assert tuned.tasks == ["relation"] and tuned.facts >= 4
    for args in (tuned, held_out):
        for length in args.lengths:
            trials = recall.trials_per_kind(args, length)
            assert trials * len(args.kinds) * args.facts >= 56
    assert recall.trials_per_kind(named, 131072) == 2


@pytest.mark.parametrize(
    "argv", [["--kinds", "news"], ["--held-out", "--kinds", "docs"], ["--kinds", "docs", "info"]]
)
def test_tuned_and_held_out_kinds_never_share_a_run(monkeypatch, argv):
    monkeypatch.setattr(recall, "run", lambda args: pytest.fail("ran"))
    with pytest.raises(SystemExit):
        recall.main(argv)


def test_each_length_ends_with_a_line_per_mode_paired_with_the_others(capsys):
    def answers(*right):
        return [
            Answer(ok, 1.0, 100, "", ("1",), question=f"news:0:{j}") for j, ok in enumerate(right)
        ]

    run = recall.Run(argparse.Namespace(kind_set="held_out"), None, None, {}, approx_tokens)
    run.cells[8192, "news", "relation", "reference", None] = answers(True, False, False, False)
    run.cells[8192, "news", "relation", "session", "segments"] = answers(True, True, True, False)
    run.cells[16384, "news", "relation", "session", "segments"] = answers(False)
    table = recall.compare_length(run, 8192)
    assert table["session/segments"]["vs"]["reference/-"] == {
        "won": 2,
        "lost": 0,
        "pairs": 4,
        "p": 0.5,
    }
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["row"] for line in lines] == ["reference/-", "session/segments"]
    assert lines[1]["kind_set"] == "held_out" and lines[1]["correct"] == 3 and lines[1]["n"] == 4
    assert lines[1]["questions_right"] == ["news:0:0", "news:0:1", "news:0:2"]
    assert "8192 session/segments 3/4 (" in err and "vs reference/- +2 -0 p=0.5" in err


def test_memory_dtypes_measure_each_memory_cell_once_per_dtype(monkeypatch):
    """`--memory-dtypes float16 int8`: every inline and session cell of a strategy with memory
    blocks runs once per dtype in the same run, as a strategy of its own; baselines and
    larimar once. `--variants NAME=JSON` does the same with named knob sets."""
    from argparse import Namespace

    from bench.recall import Run, combos, main

    with pytest.raises(SystemExit):
        main(["--memory-dtypes", "int4"])
    seen = []
    monkeypatch.setattr(recall, "run", seen.append)
    main(["--memory-dtypes", "float16", "int8"])
    main(["--variants", 'dense={"prior_match": "dense"}', 'hybrid={"prior_match": "hybrid"}'])
    dtypes, named = seen
    assert dtypes.variants == {
        "float16": {"memory_dtype": "float16"},
        "int8": {"memory_dtype": "int8"},
    }
    assert named.variants["hybrid"] == {"prior_match": "hybrid"}
    for bad in (["--variants", "x=[1]"], ["--variants", "x={", "y={}"], ["--variants", "=1"],
                ["--variants", "a={}", "a={}"], ["--memory-dtypes", "int8", "--variants", "a={}"]):  # fmt: skip
        with pytest.raises(SystemExit):
            main(bad)
    args = Namespace(modes=["rag", "session"], strategies=["segments", "larimar"])
    args.variants = dtypes.variants
    assert combos(args) == [
        ("rag", None),
        ("session", "segments@float16"),
        ("session", "segments@int8"),
        ("session", "larimar"),
    ]
    args.variants, args.knobs = named.variants, {"k": 4}
    asked = Run(args, None, None, {}, approx_tokens)
    assert asked._memory("segments@hybrid") == {
        "strategy": "segments",
        "k": 4,
        "prior_match": "hybrid",
    }
    assert asked._memory("segments") == {"strategy": "segments", "k": 4}
    args.variants = {}
    assert combos(args)[1:] == [("session", "segments"), ("session", "larimar")]
