"""`longserve adapt` (bench/adapt.py, bench/adapt_tasks.py): its tasks read only the tuned
kinds of text and plant relations of their own, asking each fact by its key; a short run on a
tiny model writes an adapter the engine reads, with the command that made it."""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Iterator

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bench import adapt, adapt_lists, adapt_tasks, recall_tasks
from engine.runner.adapter import read_adapter
from engine.runner.loader import load_model


def words(texts) -> list[int]:
    return [len(t.split()) for t in texts]


def test_tasks_ask_every_planted_fact_by_its_key_in_tuned_prose(monkeypatch):
    read = []
    original = adapt_tasks.kind_paragraphs
    monkeypatch.setattr(
        adapt_tasks, "kind_paragraphs", lambda kind, seed: read.append(kind) or original(kind, seed)
    )
    for task in itertools.islice(adapt_tasks.tasks(3, words, tokens=(100, 300)), 6):
        assert 2 <= len(task.questions) <= 10
        for question, sentence in task.questions:
            assert sentence in task.passage  # the answer is the planted sentence
            # the key: the question's rarest capitalized word in the sentence ("Mount" in
            # "the height of Mount Tamjentam" is a relation's word, on every mountain)
            names = [w for w in re.findall(r"[A-Z][a-z]+", question) if w in sentence]
            key = min(names, key=task.passage.count)
            assert task.passage.count(key) == 1  # the key names one fact
    assert set(read) == set(adapt_tasks.TRAIN_KINDS) == {"manpages", "docs", "docstrings"}


@pytest.mark.parametrize("relations", ["fixed", "generated"])
def test_list_tasks_ask_every_key_for_all_its_values_in_passage_order(relations):
    lists = 0
    draw = adapt_tasks.tasks(5, words, tokens=(100, 300), lists=0.5, list_relations=relations)
    for task in itertools.islice(draw, 12):
        for question, answer in task.questions:
            values = re.findall(r"\d{5,}", answer)
            if len(values) < 2:
                continue
            lists += 1
            places = [task.passage.index(value) for value in values]
            assert places == sorted(places)  # listed as the passage gives them
            key = next(w for w in re.findall(r"[A-Z][a-z]+", question) if w in answer)
            facts = [s for s in task.passage.split("\n\n") if key in s]
            assert sorted(re.findall(r"\d{5,}", " ".join(facts))) == sorted(values)
    assert lists >= 3


def test_a_list_answered_in_sentences_copies_each_values_own_sentence_in_turn():
    """--list-answer sentences: the answer is the key's planted sentences, in passage order;
    the passages and questions are the ones the one-sentence form draws."""
    draw = adapt_tasks.tasks(5, words, tokens=(100, 300), lists=0.5, list_answer="sentences")
    plain = adapt_tasks.tasks(5, words, tokens=(100, 300), lists=0.5)
    lists = 0
    for task, same in itertools.islice(zip(draw, plain, strict=False), 12):  # endless draws
        assert task.passage == same.passage
        assert [q for q, _ in task.questions] == [q for q, _ in same.questions]
        for (_, answer), (_, listed) in zip(task.questions, same.questions, strict=True):
            values = re.findall(r"\d{5,}", answer)
            assert values == re.findall(r"\d{5,}", listed)
            if len(values) < 2:
                continue
            lists += 1
            sentences = re.split(r"(?<=\.) ", answer)
            assert len(sentences) == len(values)
            places = [task.passage.index(s) for s in sentences]  # each one planted, in order
            assert places == sorted(places)
    assert lists >= 3


def test_a_generated_relation_words_each_value_several_ways_and_asks_in_grammar():
    rng = random.Random(1)
    for relation in (adapt_lists.generated(rng) for _ in range(50)):
        assert 3 <= len(relation.facts) == len(set(relation.facts))
        assert all(f.count("{key}") == f.count("{value}") == 1 for f in relation.facts)
        assert all(q.count("{key}") == 1 and "{value" not in q for q in relation.questions)
        assert relation.answer.count("{values}") == 1
        plural = [q for q in relation.questions if q.startswith(("Which", "Give all"))]
        assert not any(re.search(r" (is|was|belongs) ", q) for q in plural)
    keys = {adapt_lists.generated(rng).answer for _ in range(50)}
    assert len(keys) > 30  # many relations, not a handful


def fixed_paragraphs(kind: str, seed) -> Iterator[str]:
    """Paragraphs that depend on nothing installed: the draws below are the same on every
    machine (the real ones read /usr/share/doc, which apt changes)."""
    rng = random.Random(f"{kind}:{seed}")
    return (f"{kind} paragraph {i} " + "word " * rng.randint(5, 120) for i in itertools.count())


def test_no_lists_draws_the_tasks_the_shipped_adapter_was_trained_on(monkeypatch):
    """lists=0 draws what tasks() drew before list tasks existed: the same random calls in
    the same order (the questions a7c3181 drew; on machine-independent paragraphs they are
    the same)."""
    monkeypatch.setattr(adapt_tasks, "kind_paragraphs", fixed_paragraphs)

    def take(**kw):
        return list(itertools.islice(adapt_tasks.tasks(2, words, tokens=(100, 200), **kw), 4))

    assert take()[0].questions[0] == (
        "What is the record number of patient Eftekvescha?",
        "The record number of patient Eftekvescha is 2128045.",
    )
    assert take()[3].questions[0] == (
        "How high above Earth does the spacecraft Yolin circle?",
        "The Yolin satellite orbits 6504855 metres above the ground.",
    )
    assert take() != take(lists=1.0)


def test_the_relations_are_not_the_recall_benchs():
    ours = {f for r in adapt_tasks.RELATIONS for f in r.facts + r.questions + r.paraphrases}
    ours |= {f for r in adapt_tasks.LIST_RELATIONS for f in (*r.facts, *r.questions, r.answer)}
    rng = random.Random(0)
    drawn = {
        f
        for _ in range(200)
        for r in [adapt_lists.generated(rng)]
        for f in (*r.facts, *r.questions, r.answer)
    }
    ours |= drawn
    bench = {
        f
        for r in [*recall_tasks.RELATIONS.values(), recall_tasks.VAULT]
        for f in (*r.facts, r.question, r.paraphrase)
    }
    assert not ours & bench
    bench_lists = {*recall_tasks.MULTIVALUE_FACTS, recall_tasks.MULTIVALUE_QUESTION}
    assert not ours & bench_lists
    bench_words = {"badge", "expedition", "issued", "ship", "village", "telescope", "archive"}
    bench_words |= {"contract", "vault", "serial", "registration", "reference"}
    assert not any(set(re.findall(r"[a-z]+", f.lower())) & bench_words for f in drawn)
    assert not set(adapt_tasks.SYLLABLES) & set(recall_tasks.SYLLABLES)


def test_a_short_run_writes_an_adapter_the_engine_reads(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "tiny.safetensors"
    adapt.main(
        ["--steps", "2", "--eval-tasks", "1", "--model", str(tiny_model_dir), "--out", str(out)]
    )
    lines = capsys.readouterr().out.splitlines()
    assert '"step": 2' in lines[1] and '"eval"' in lines[2]
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["command"].startswith("longserve adapt --steps 2") and meta["lead"] == "3"
    from engine.config import EngineConfig

    loaded = load_model(EngineConfig(model=str(tiny_model_dir), device="cpu"))
    adapter = read_adapter(out, loaded.model)
    assert adapter.rank == 8 and len(adapter.a) == 2


def test_a_run_can_start_from_a_saved_adapter(tiny_model_dir, tmp_path, capsys):
    """--init: training starts from that adapter's A and B, and its command says so."""
    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    common = ["--eval-tasks", "0", "--model", str(tiny_model_dir)]
    adapt.main(["--steps", "1", *common, "--out", str(first)])
    adapt.main(["--steps", "0", *common, "--init", str(first), "--out", str(second)])
    with safe_open(str(first), framework="pt") as a, safe_open(str(second), framework="pt") as b:
        assert a.keys() == b.keys()
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())  # noqa: SIM118
        assert b.metadata()["command"].endswith(f"--init {first}")
    with pytest.raises(SystemExit, match="alpha 16.0, not this run's --alpha 8.0"):
        adapt.main(["--steps", "0", *common, "--alpha", "8", "--init", str(first), "--out", "x"])
    bad = tmp_path / "bad.safetensors"
    save_file({"layers.0.q.A": torch.zeros(2, 2)}, str(bad))
    with pytest.raises(SystemExit, match="not an adapter"):
        adapt.main(["--steps", "0", *common, "--init", str(bad), "--out", str(second)])


def test_a_framed_answer_names_what_the_frame_holds_in_its_order():
    from bench.adapt_frames import framed_answer

    sentence = "Cabinet Kane holds folders 111111, 222222 and 333333."
    frame = "... folder 333333 ... Folder 111111 is kept in cabinet Kane ..."
    assert framed_answer(sentence, frame) == "Cabinet Kane holds folders 333333 and 111111."
    assert framed_answer("Locker Ur opens with 55555.", frame) is None
    assert framed_answer("Locker Ur opens with 111111.", frame) == "Locker Ur opens with 111111."
    sentences = "Cabinet Kane holds folder 111111. Folder 222222 is kept in cabinet Kane."
    frame = "... Folder 222222 is kept in cabinet Kane ... Cabinet Kane holds folder 111111 ..."
    assert framed_answer(sentences, frame) == (
        "Folder 222222 is kept in cabinet Kane. Cabinet Kane holds folder 111111."
    )


def test_frames_train_on_the_prompt_a_sessions_answer_reads(tiny_model_dir, tmp_path, capsys):
    """--frames: the passage is read into a session memory and each question asked the way a
    session chat asks it; the step trains on the frame's tokens, which retrieval chose from a
    passage longer than the tiny model's 256-token window."""
    from bench.adapt_frames import FrameReader

    knobs = {"sinks": 8, "local_window": 64, "chunk_size": 32, "block": 16, "k": 2, "u": 1}
    reader = FrameReader(adapt.LEAD, str(tiny_model_dir), knobs)
    tokens = reader.loaded.tokenizer
    task = adapt_tasks.Task(
        "\n\n".join(f"Paragraph {i} says nothing of note at all." for i in range(80))
        + "\n\nLocker Kane opens with the combination 4455667.",
        (("What is the combination of locker Kane?", "Locker Kane opens with 4455667."),),
    )
    passage = len(tokens(task.passage)["input_ids"])
    [(ids, sentence)] = reader.examples(task)  # the frame holds the fact (else: none)
    assert passage > 256 and len(ids) < passage  # a frame, not the passage
    assert sentence == task.questions[0][1] and "4455667" in tokens.decode(ids)
    out = tmp_path / "frames.safetensors"
    common = ["--eval-tasks", "1", "--model", str(tiny_model_dir), "--out", str(out)]
    framed = ["--frames", "1", "--frame-tokens", "600", "900"]
    framed += [f"--frame-knob={k}={v}" for k, v in knobs.items()]
    adapt.main(["--steps", "1", *framed, *common])
    lines = capsys.readouterr().out.splitlines()
    assert '"questions"' in lines[0] and "frames_n" in lines[1]
    with safe_open(str(out), framework="pt") as f:
        assert "--frames 1.0 --frame-tokens 600 900" in f.metadata()["command"]
