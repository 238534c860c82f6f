"""bench/relation_trace.py end to end on the embedded model, small: a multivalue trial read into
a session memory with a knob set, one JSON line per question and a summary. Its `--knob` once
raised TypeError for sessions, unnoticed, because nothing ran it."""

from __future__ import annotations

import json

import pytest

from bench.relation_trace import main

pytestmark = pytest.mark.real_model


@pytest.mark.timeout(600)
def test_a_multivalue_trace_with_a_knob_prints_each_question_and_a_summary(capsys):
    argv = ["--length", "3072", "--kind", "manpages", "--trials", "1", "--task", "multivalue",
            "--facts", "2", "--max-tokens", "4", "--knob", 'prior_match="dense"', "--frame-text"]  # fmt: skip
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    *records, summary = lines
    assert [r["q"] for r in records] == [0, 1]
    for record in records:
        assert len(record["expected"]) == 3  # a multivalue key's three values
        assert len(record["asked_layers_full"]) == 3 and len(record["prior_rank_asked"]) == 3
        assert 0 <= record["asked_in_answer"] <= 3 and isinstance(record["correct"], bool)
        assert "frame_text_correct" in record and "frame_text_holds" in record
    assert summary["summary"]["n"] == 2 and summary["length"] == 3072
    assert summary["summary"]["correct"] == sum(r["correct"] for r in records)
