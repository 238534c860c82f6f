"""bench/million's questions and documents (no model, no server): every fact and key planted
once, values that cannot answer another question, held-out text only, and a shorter length's
document the opening of a longer one's, so questions pair across lengths."""

from __future__ import annotations

import os

import pytest

from bench import million
from bench.recall_corpus import HELD_OUT_KINDS, kind_paragraphs


def words(texts: list[str]) -> list[int]:
    return [len(text.split()) for text in texts]


def have_held_out_text() -> bool:
    return any(next(kind_paragraphs(kind, "probe"), None) for kind in million.HAYSTACK_KINDS)


def test_the_haystack_is_held_out_text_only():
    assert set(million.HAYSTACK_KINDS) <= set(HELD_OUT_KINDS)


def test_questions_are_the_relation_s_facts_and_one_key_per_door():
    trial = million.questions_of(seed=3, facts=8, keys=10)
    tasks = [q.task for q in trial.questions]
    assert tasks.count("relation") == 8 and tasks.count("passkey") == 10
    values = [q.expected[0] for q in trial.questions]
    assert len(set(values)) == len(values)  # no answer fits two questions
    keys = [q for q in trial.questions if q.task == "passkey"]
    for question in keys:
        (key,) = question.expected
        assert len(key) == 5 and key.isdigit()
        planted = [f.sentence for f in trial.facts if key in f.sentence]
        assert len(planted) == 1
    depths = sorted(f.depth for f in trial.facts if "pass key" in f.sentence)
    assert [int(d * 10) for d in depths] == list(range(10))  # one per band of depth
    assert million.questions_of(seed=3, facts=8, keys=10) == trial


@pytest.mark.skipif(not have_held_out_text(), reason="no held-out text on this machine")
def test_a_shorter_document_opens_a_longer_one_and_holds_every_fact_once():
    trial = million.questions_of(seed=0, facts=4, keys=3)
    short = million.document(trial, 0, 3000, words)
    long = million.document(trial, 0, 9000, words)
    for text in (short, long):
        for fact in trial.facts:
            assert text.count(fact.sentence) == 1
    assert 2500 < len(short.split()) <= 3000 and 8000 < len(long.split()) <= 9000
    strip = [p for p in short.split("\n\n") if p not in {f.sentence for f in trial.facts}]
    opening = [p for p in long.split("\n\n") if p not in {f.sentence for f in trial.facts}]
    assert opening[: len(strip)] == strip


@pytest.mark.parametrize("ram", [None, 1 << 30])
def test_a_cell_runs_on_the_server_s_ram_unless_a_disk_cell_is_asked_for(monkeypatch, ram):
    """One length's server gets LONGSERVE_SESSION_RAM_BYTES only from --session-ram-bytes
    (128K tokens under 1 GiB: the disk tier at a length RAM could hold)."""
    seen = []

    def server(args, env):
        seen.append(env)
        raise LookupError("stop before a server starts")

    monkeypatch.setattr(million, "server", server)
    args = million.argparse.Namespace(session_ram_bytes=ram)
    with pytest.raises(LookupError):
        million.cell(args, 131072, million.questions_of(seed=0, facts=1, keys=1), "text")
    assert seen == [{} if ram is None else {"LONGSERVE_SESSION_RAM_BYTES": str(ram)}]


def test_decode_runs_keep_each_stream_and_the_median(monkeypatch):
    """--decode-runs streams, each with its CPU seconds per token (of a real process: this
    one) and the machine's dirty and writeback bytes; the median rate over them."""
    rates = iter([30.0, 50.0, 40.0])

    def ask(http, model, text, strategy, max_tokens, api, session, on_first):
        assert (api, session, max_tokens) == ("completions", "s1", 8)
        on_first()  # the first token: the decode's CPU is counted from here
        return {"ttft_s": 0.1, "decode_tok_s": next(rates), "completion_tokens": max_tokens}

    monkeypatch.setattr(million, "ask", ask)
    args = million.argparse.Namespace(decode_runs=3, decode_tokens=8)
    out = million.decode_runs(args, None, "m", "s1", os.getpid())
    assert out["decode_tok_s"] == 40.0
    assert [r["decode_tok_s"] for r in out["runs"]] == [30.0, 50.0, 40.0]
    for run in out["runs"]:
        assert run["cpu_s_per_token"] >= 0 and run["Dirty"] >= 0 and run["Writeback"] >= 0
