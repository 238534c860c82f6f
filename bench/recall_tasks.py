"""Facts to plant in a document, the questions that ask for them, and how answers are scored.

Every key is an invented name (syllables drawn from a seeded generator) and every value a 5-7
digit number, so neither can be found in the filler (`bench.recall_corpus` drops paragraphs
with numbers that long). Each relation has several sentence forms for the fact, drawn at
random, a literal question that repeats the fact's words, and a paraphrase that shares none of
its content words but the key's name. One trial's document holds the facts of every task, each
fact a paragraph of its own at a seeded random depth:

- `relation` (the recall bench's default): k facts of one relation (`facts_of_relation`), each
  its own key and value, each asked in its own chat, a seeded half of them with the paraphrase:
  a contract has many dates, a log many codes, so the asked fact's distractors are of its own
  form. Their depths are spread: each fact lies in its own 1/k of the document, seeded order;
- `single`: one fact, asked literally;
- `multikey`: several facts of one relation with different keys, each asked literally in its
  own chat (RULER's multi-key: the others are distractors of the same form);
- `multivalue`: several values planted for one key, asked once; every value must be listed;
- `paraphrase`: one fact, asked with the paraphrase;
- `followup`: two keepers of two vaults, and both vaults' codes; the first turn asks which
  vault one keeper keeps, the second, in the same chat, the code "of the vault whose name you
  just gave", which only the first answer names.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

TOKENS_PER_LISTED_VALUE = 24  # answer room for each further value of a multivalue list
TASKS = ("relation", "single", "multikey", "multivalue", "paraphrase", "followup")
# the mix of issue 15 that the recall figures before decision 069 were measured with
MIXED_TASKS = ("single", "multikey", "multivalue", "paraphrase", "followup")
DEFAULT_TASKS = ("relation",)
SYLLABLES = [
    "bar",
    "vel",
    "dor",
    "quin",
    "mar",
    "tes",
    "lo",
    "ren",
    "zu",
    "kai",
    "thal",
    "ost",
    "wyn",
    "fen",
    "gar",
    "ix",
    "ul",
    "bra",
    "cor",
    "mi",
    "sev",
    "dru",
    "pel",
    "nor",
    "ash",
    "vim",
    "tor",
    "eld",
    "gri",
    "sa",
]


@dataclass(frozen=True)
class Relation:
    facts: tuple[str, ...]  # sentence forms with {key} and {value}
    question: str  # literal: the fact's own words
    paraphrase: str  # shares no content word with any form but the key


RELATIONS = {
    "ship": Relation(
        (
            "The registration number of the ship {key} is {value}.",
            "The ship {key} was registered under number {value}.",
            "Port records list the ship {key} with registration number {value}.",
        ),
        "What is the registration number of the ship {key}?",
        "Which official identifier was the vessel {key} enrolled with?",
    ),
    "village": Relation(
        (
            "The village of {key} has a population of {value}.",
            "Exactly {value} people live in the village of {key}.",
            "The last census counted {value} residents in the village of {key}.",
        ),
        "What is the population of the village of {key}?",
        "How many inhabitants does {key} have?",
    ),
    "telescope": Relation(
        (
            "The serial number of the {key} telescope is {value}.",
            "The {key} telescope carries the serial number {value}.",
            "Stamped on the {key} telescope is the serial number {value}.",
        ),
        "What is the serial number of the {key} telescope?",
        "Which factory identification is engraved on the {key} observing instrument?",
    ),
    "archive": Relation(
        (
            "The {key} archive contains {value} letters.",
            "In total, {value} letters are kept in the {key} archive.",
            "The {key} archive holds {value} letters.",
        ),
        "How many letters does the {key} archive contain?",
        "What is the count of correspondence stored within {key}'s collection?",
    ),
    "contract": Relation(
        (
            "The {key} contract was filed under reference number {value}.",
            "Reference number {value} belongs to the {key} contract.",
            "The clerk filed the {key} contract as reference number {value}.",
        ),
        "What is the reference number of the {key} contract?",
        "Which docket identifier was the {key} agreement given?",
    ),
}
# the relations the mixed tasks draw from, in the order their seeded shuffle has always used
MIXED_RELATIONS = ("ship", "village", "telescope", "archive")
VAULT = Relation(
    (
        "The access code for the {key} vault is {value}.",
        "To open the {key} vault, one enters the code {value}.",
        "The {key} vault opens only with the code {value}.",
    ),
    "What is the access code for the {key} vault?",
    "Which number unlocks the {key} strongroom?",
)
KEEPER_FACTS = (
    "{person} is the keeper of the {key} vault.",
    "The {key} vault is looked after by {person}.",
    "{person} has been the keeper of the {key} vault for many years.",
)
KEEPER_QUESTION = "Which vault is {person} the keeper of?"
FOLLOWUP_QUESTION = "And what is the access code for the vault whose name you just gave?"
MULTIVALUE_FACTS = (
    "One of the badge numbers issued to the {key} expedition is {value}.",
    "The {key} expedition was also issued the badge number {value}.",
    "Another badge number given to the {key} expedition is {value}.",
)
MULTIVALUE_QUESTION = "What are all the badge numbers issued to the {key} expedition?"


@dataclass(frozen=True)
class Fact:
    sentence: str
    depth: float  # 0..1: where in the document its paragraph goes


@dataclass(frozen=True)
class Question:
    """One scored question: the turns of its chat (a follow-up has two) and what the last
    answer must contain (every value; a follow-up's first answer is checked too)."""

    task: str
    turns: tuple[str, ...]
    expected: tuple[str, ...]
    first_expected: str | None = None
    paraphrased: bool = False


@dataclass(frozen=True)
class Trial:
    facts: tuple[Fact, ...]
    questions: tuple[Question, ...]


class Names:
    """Invented names, none drawn twice in one trial."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set[str]()

    def name(self, syllables: int = 3) -> str:
        while True:
            name = "".join(self.rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()
            if name not in self.used:
                self.used.add(name)
                return name

    def value(self) -> str:
        while True:
            value = str(self.rng.randint(10_000, 9_999_999))
            if value not in self.used:
                self.used.add(value)
                return value


def make_trial(
    seed: int | str,
    tasks: tuple[str, ...] = MIXED_TASKS,
    keys: int = 3,
    values: int = 3,
    facts_of_relation: int = 8,
) -> Trial:
    """The facts and questions of one trial: the same for every mode and strategy it is asked
    in, and for the reference document. `keys` is multikey's count of facts, `values`
    multivalue's values, `facts_of_relation` the relation task's facts."""
    rng = random.Random(f"recall-trial:{seed}")
    names = Names(rng)
    relations = list(MIXED_RELATIONS)
    rng.shuffle(relations)
    facts: list[Fact] = []
    questions: list[Question] = []

    def plant(form: str, depth: float | None = None, **fields: str) -> None:
        facts.append(Fact(form.format(**fields), rng.random() if depth is None else depth))

    def planted(relation: Relation, depth: float | None = None) -> tuple[str, str]:
        key, value = names.name(), names.value()
        plant(rng.choice(relation.facts), depth, key=key, value=value)
        return key, value

    for task in tasks:
        if task == "relation":
            # the vault's codes are the follow-up's too: only one task of a trial plants them
            pool = [name for name in RELATIONS if name in relations or name not in MIXED_RELATIONS]
            name = rng.choice(pool + ([] if "followup" in tasks else ["vault"]))
            relation = RELATIONS.get(name, VAULT)
            if name in relations:
                relations.remove(name)
            bands = list(range(facts_of_relation))
            rng.shuffle(bands)
            reworded = set(rng.sample(bands, facts_of_relation // 2))
            for band in bands:
                key, value = planted(relation, (band + rng.random()) / facts_of_relation)
                form = relation.paraphrase if band in reworded else relation.question
                asked = (form.format(key=key),)
                questions.append(Question(task, asked, (value,), None, band in reworded))
        elif task in ("single", "paraphrase"):
            relation = RELATIONS[relations.pop()]
            key, value = planted(relation)
            form = relation.question if task == "single" else relation.paraphrase
            paraphrased = task == "paraphrase"
            questions.append(Question(task, (form.format(key=key),), (value,), None, paraphrased))
        elif task == "multikey":
            relation = RELATIONS[relations.pop()]
            for key, value in [planted(relation) for _ in range(keys)]:
                questions.append(Question(task, (relation.question.format(key=key),), (value,)))
        elif task == "multivalue":
            key, numbers = names.name(), [names.value() for _ in range(values)]
            for value in numbers:
                plant(rng.choice(MULTIVALUE_FACTS), key=key, value=value)
            questions.append(Question(task, (MULTIVALUE_QUESTION.format(key=key),), tuple(numbers)))
        elif task == "followup":
            people = [f"{names.name(2)} {names.name()}" for _ in range(2)]
            vaults, codes = [names.name() for _ in range(2)], [names.value() for _ in range(2)]
            for person, vault, code in zip(people, vaults, codes, strict=True):
                plant(rng.choice(KEEPER_FACTS), person=person, key=vault)
                plant(rng.choice(VAULT.facts), key=vault, value=code)
            turns = (KEEPER_QUESTION.format(person=people[0]), FOLLOWUP_QUESTION)
            questions.append(Question(task, turns, (codes[0],), first_expected=vaults[0]))
        else:
            raise ValueError(f"unknown task {task!r}")
    return Trial(tuple(facts), tuple(questions))


def plant_facts(paragraphs: list[str], facts: tuple[Fact, ...]) -> list[str]:
    """`paragraphs` with each fact a paragraph of its own before the paragraph at its depth (by
    count of paragraphs); a document joins them with blank lines."""
    placed = sorted(
        ((round(fact.depth * len(paragraphs)), i) for i, fact in enumerate(facts)), reverse=True
    )
    out = list(paragraphs)
    for at, i in placed:
        out.insert(at, facts[i].sentence)
    return out


def normalize(answer: str) -> str:
    """Digits grouped with commas, spaces or thin spaces ("1,234,567") written plainly."""
    return re.sub(r"(?<=\d)[,\u202f\u2009 ](?=\d{3}\b)", "", answer)


def contains(answer: str, expected: str) -> bool:
    """A number must stand alone (12345 is not in 123456); a name, case aside, anywhere."""
    if expected.isdigit():
        return re.search(rf"(?<!\d){expected}(?!\d)", normalize(answer)) is not None
    return expected.lower() in answer.lower()


def is_correct(answer: str, expected: tuple[str, ...], exact: bool = False) -> bool:
    """Every expected value in the answer; with `exact` (a list, multivalue) also no other
    number of a value's size (5 digits or more): a list with an invented entry is wrong."""
    if not all(contains(answer, value) for value in expected):
        return False
    if not exact:
        return True
    return set(re.findall(r"(?<!\d)\d{5,}(?!\d)", normalize(answer))) <= set(expected)


def answer_budget(max_tokens: int, question: Question) -> int:
    """max_tokens for one value; a list (multivalue) gets room for each further value: a
    7-digit value takes 7 tokens of SmolLM2's, a numbered line 11, one that names the key 20."""
    return max_tokens + TOKENS_PER_LISTED_VALUE * (len(question.expected) - 1)


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion (95 % by default); (0, 1) when n is 0."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)
