"""Synthetic retrieval tasks for `longserve adapt`: a passage of installed prose holding several
facts of one relation, a question naming one fact's key, and the fact's sentence as the answer;
or (with `lists`) keys that each hold several values, one sentence per value, a question asking
for all of a key's values, and one sentence listing them as the answer.

The text comes from the recall bench's tuned kinds only (`manpages`, `docs`, `docstrings`); the
held-out kinds (`news`, `info`, `licenses`) are never read here, so the adapter is judged on
text it never saw. The relations, their sentences, questions and paraphrases, and the names'
syllables are this module's own, none of `bench.recall_tasks`'s: the adapter learns to find
the sentence that names the asked key among sentences of its own shape and to copy it, not
the bench's relations.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bench.adapt_lists import LIST_RELATIONS, generated
from bench.recall_corpus import kind_paragraphs

TRAIN_KINDS = ("manpages", "docs", "docstrings")  # bench.recall_corpus's tuned kinds


@dataclass(frozen=True)
class Relation:
    facts: tuple[str, ...]  # sentence forms with {key} and {value}
    questions: tuple[str, ...]  # literal: the fact's words
    paraphrases: tuple[str, ...]  # the key's name and no other content word of a form


RELATIONS = (
    Relation(
        (
            "Locker {key} opens with the combination {value}.",
            "The combination of locker {key} is {value}.",
        ),
        ("What is the combination of locker {key}?",),
        ("Which digits unlock the storage compartment {key}?",),
    ),
    Relation(
        ("Invoice {key} totals {value} dollars.", "The total of invoice {key} is {value} dollars."),
        ("What is the total of invoice {key}?",),
        ("How much money is billed on statement {key}?",),
    ),
    Relation(
        (
            "Mount {key} rises {value} millimetres above the sea.",
            "The height of Mount {key} is {value} millimetres.",
        ),
        ("What is the height of Mount {key}?",),
        ("How tall is the peak called {key}?",),
    ),
    Relation(
        (
            "The {key} express runs as train number {value}.",
            "Train number {value} is the {key} express.",
        ),
        ("What train number does the {key} express run as?",),
        ("Under which service identifier does the {key} railway line operate?",),
    ),
    Relation(
        (
            "The book {key} is catalogued under call number {value}.",
            "Call number {value} belongs to the book {key}.",
        ),
        ("What is the call number of the book {key}?",),
        ("Where on the library shelves is the volume {key} filed?",),
    ),
    Relation(
        (
            "Parcel {key} has the tracking number {value}.",
            "The tracking number of parcel {key} is {value}.",
        ),
        ("What is the tracking number of parcel {key}?",),
        ("Which code follows the shipment {key} through the post?",),
    ),
    Relation(
        (
            "The telephone extension of {key} is {value}.",
            "{key} answers calls on extension {value}.",
        ),
        ("What is the telephone extension of {key}?",),
        ("Which line should one dial to reach {key} by phone?",),
    ),
    Relation(
        (
            "The {key} factory built {value} bicycles last year.",
            "Last year, {value} bicycles left the {key} factory.",
        ),
        ("How many bicycles did the {key} factory build last year?",),
        ("What was the annual output of cycles at the {key} works?",),
    ),
    Relation(
        (
            "The {key} bridge spans {value} centimetres.",
            "The length of the {key} bridge is {value} centimetres.",
        ),
        ("What is the length of the {key} bridge?",),
        ("How far does the crossing named {key} reach from bank to bank?",),
    ),
    Relation(
        (
            "Building permit {value} was issued for the {key} tower.",
            "The {key} tower was built under permit {value}.",
        ),
        ("Which building permit was issued for the {key} tower?",),
        ("What authorisation allowed construction of {key}'s high-rise?",),
    ),
    Relation(
        (
            "The winning ticket of the {key} lottery was number {value}.",
            "In the {key} lottery, ticket {value} won.",
        ),
        ("Which ticket won the {key} lottery?",),
        ("What was the lucky draw result in {key}'s sweepstake?",),
    ),
    Relation(
        (
            "The {key} satellite orbits {value} metres above the ground.",
            "The orbit of the {key} satellite lies {value} metres up.",
        ),
        ("At what altitude does the {key} satellite orbit?",),
        ("How high above Earth does the spacecraft {key} circle?",),
    ),
    Relation(
        (
            "Account {key} holds a balance of {value} euros.",
            "The balance of account {key} is {value} euros.",
        ),
        ("What is the balance of account {key}?",),
        ("How much money sits in the deposit called {key}?",),
    ),
    Relation(
        (
            "Patient {key} was given record number {value}.",
            "The record number of patient {key} is {value}.",
        ),
        ("What is the record number of patient {key}?",),
        ("Which file identifier does the clinic use for {key}?",),
    ),
)


SYLLABLES = [
    "ka",
    "ne",
    "pro",
    "sil",
    "tam",
    "ur",
    "ves",
    "lin",
    "dak",
    "mo",
    "rhe",
    "sto",
    "pi",
    "gan",
    "ef",
    "ol",
    "tri",
    "bel",
    "nak",
    "yo",
    "cha",
    "fir",
    "hub",
    "jen",
    "qua",
    "rol",
    "sim",
    "tek",
    "wen",
    "zor",
]


@dataclass(frozen=True)
class Task:
    """One passage and its questions: (question, the fact's sentence) each."""

    passage: str
    questions: tuple[tuple[str, str], ...]
    lists: bool = False  # its questions ask for list_facts' keys


def _name(rng: random.Random, used: set[str]) -> str:
    while True:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize()
        if name not in used:
            used.add(name)
            return name


def _value(rng: random.Random, used: set[str]) -> str:
    while True:
        value = str(rng.randint(10_000, 9_999_999))
        if value not in used:
            used.add(value)
            return value


def listed(values: list[str]) -> str:
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} and {values[-1]}"


def list_facts(
    rng: random.Random, used: set[str], sentences: bool = False, generate: bool = False
) -> tuple[list[str], list[tuple[str, str]]]:
    """A list relation's facts and questions: 2-4 keys of 1-4 values each, the values'
    sentences apart; the answer lists a key's values in the passage's order of its facts, in
    one sentence, or (`sentences`) as each value's own sentence in turn. The relation is one
    of the six fixed ones, or (`generate`) one drawn by bench.adapt_lists.generated."""
    relation = generated(rng) if generate else rng.choice(LIST_RELATIONS)
    planted: list[tuple[str, str, str]] = []  # (sentence, key, value)
    for _ in range(rng.randint(2, 4)):
        key = _name(rng, used)
        for _ in range(rng.randint(1, 4)):
            value = _value(rng, used)
            planted.append((rng.choice(relation.facts).format(key=key, value=value), key, value))
    rng.shuffle(planted)
    asked = []
    for key in dict.fromkeys(key for _, key, _ in planted):
        values = [value for _, k, value in planted if k == key]
        answer = relation.answer.format(key=key, values=listed(values))
        if sentences:
            answer = " ".join(sentence for sentence, k, _ in planted if k == key)
        asked.append((rng.choice(relation.questions).format(key=key), answer))
    return [sentence for sentence, _, _ in planted], asked


def tasks(
    seed: int | str,
    count_tokens: Callable[[list[str]], list[int]],
    tokens: tuple[int, int] = (300, 1400),
    facts: tuple[int, int] = (2, 10),
    lists: float = 0.0,
    list_answer: str = "list",
    list_relations: str = "fixed",
) -> Iterator[Task]:
    """Endless tasks of this seed: a passage of `tokens` (range) of one tuned kind's prose with
    `facts` (range) facts of one relation at random places, and sometimes one or two of another
    relation; every fact of the first relation asked, about half of them by a paraphrase. A
    `lists` share of passages holds list_facts instead (their facts in passage order), with
    the same distractors, answered as `list_answer` says ("list": one sentence; "sentences":
    each value's own sentence in turn) over `list_relations` ("fixed": the six; "generated":
    bench.adapt_lists.generated). lists=0 draws exactly what it drew before lists existed."""
    rng = random.Random(f"adapt:{seed}")
    list_rng = random.Random(f"adapt-lists:{seed}")
    sources = {kind: kind_paragraphs(kind, f"adapt:{seed}") for kind in TRAIN_KINDS}
    while True:
        kind = rng.choice(TRAIN_KINDS)
        budget, paragraphs, total = rng.randint(*tokens), [], 0
        while total < budget:
            batch = [next(sources[kind]) for _ in range(8)]
            for paragraph, n in zip(batch, count_tokens(batch), strict=True):
                if n < 300 and total < budget:  # long paragraphs would make few, long passages
                    paragraphs.append(paragraph)
                    total += n
        used: set[str] = set()
        relation, other = rng.sample(RELATIONS, 2)
        planted, asked = [], []
        as_list = lists > 0 and list_rng.random() < lists
        if as_list:
            planted, asked = list_facts(
                list_rng, used, list_answer == "sentences", list_relations == "generated"
            )
        else:
            for _ in range(rng.randint(*facts)):
                key, value = _name(rng, used), _value(rng, used)
                sentence = rng.choice(relation.facts).format(key=key, value=value)
                planted.append(sentence)
                forms = relation.paraphrases if rng.random() < 0.5 else relation.questions
                asked.append((rng.choice(forms).format(key=key), sentence))
        if as_list:  # in order: the answer lists a key's values as the passage gives them
            spots = sorted(list_rng.randint(0, len(paragraphs)) for _ in planted)
            for offset, (spot, sentence) in enumerate(zip(spots, planted, strict=True)):
                paragraphs.insert(spot + offset, sentence)
            planted = []
        for _ in range(rng.choice((0, 0, 1, 2))):
            key, value = _name(rng, used), _value(rng, used)
            planted.append(rng.choice(other.facts).format(key=key, value=value))
        for sentence in planted:
            paragraphs.insert(rng.randint(0, len(paragraphs)), sentence)
        rng.shuffle(asked)
        yield Task("\n\n".join(paragraphs), tuple(asked), as_list)
