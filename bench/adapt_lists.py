"""List relations for `longserve adapt`: a key (an owner) holding several values, one sentence
per value, asked for all of them. The six fixed relations are what decisions 080-086 trained
on; `generated` draws a relation from owners x items x verbs, each value's sentence in one of
several wordings, so that listing is learned over many relations and wordings instead of six
(decision 092). None of the words is the recall bench's (tests/engine/test_adapt_training.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ListRelation:
    facts: tuple[str, ...]  # one value each: {key} and {value}
    questions: tuple[str, ...]  # all of a key's values
    answer: str  # {key} and {values}: "A, B and C"


LIST_RELATIONS = (
    ListRelation(
        ("Cabinet {key} holds folder {value}.", "Folder {value} is kept in cabinet {key}."),
        ("Which folders does cabinet {key} hold?", "List the folders kept in cabinet {key}."),
        "Cabinet {key} holds folders {values}.",
    ),
    ListRelation(
        ("Ship {key} carried container {value}.", "Container {value} sailed on ship {key}."),
        ("Which containers did ship {key} carry?", "Name every container that sailed on {key}."),
        "Ship {key} carried containers {values}.",
    ),
    ListRelation(
        ("Runner {key} wore bib {value} in one race.", "In another race, {key} wore bib {value}."),
        ("Which bibs did runner {key} wear?", "What were all of {key}'s race bibs?"),
        "Runner {key} wore bibs {values}.",
    ),
    ListRelation(
        ("Meter {value} belongs to the {key} plant.", "The {key} plant also runs meter {value}."),
        ("Which meters belong to the {key} plant?", "List every meter the {key} plant runs."),
        "The {key} plant runs meters {values}.",
    ),
    ListRelation(
        ("Recipe {key} calls for jar {value}.", "Jar {value} is used in recipe {key}."),
        ("Which jars does recipe {key} call for?", "Name all the jars used in recipe {key}."),
        "Recipe {key} calls for jars {values}.",
    ),
    ListRelation(
        ("Pilot {key} flew route {value}.", "Route {value} was flown by pilot {key} as well."),
        ("Which routes did pilot {key} fly?", "What are all the routes {key} has flown?"),
        "Pilot {key} flew routes {values}.",
    ),
)

OWNERS = (
    "the {key} laboratory",
    "warehouse {key}",
    "the {key} orchestra",
    "captain {key}",
    "the {key} clinic",
    "the {key} mine",
    "the {key} regiment",
    "professor {key}",
    "the {key} farm",
    "the {key} school",
    "the {key} station",
    "the {key} guild",
    "the {key} workshop",
    "studio {key}",
    "the {key} depot",
    "the {key} observatory",
    "the {key} brewery",
    "doctor {key}",
    "the {key} theatre",
    "the {key} hotel",
)
ITEMS = (
    ("crate", "crates"),
    ("permit", "permits"),
    ("licence", "licences"),
    ("room", "rooms"),
    ("part number", "part numbers"),
    ("plot", "plots"),
    ("vial", "vials"),
    ("ticket", "tickets"),
    ("order", "orders"),
    ("account", "accounts"),
    ("locker", "lockers"),
    ("seat", "seats"),
    ("channel", "channels"),
    ("batch", "batches"),
    ("certificate", "certificates"),
    ("policy", "policies"),
    ("pallet", "pallets"),
    ("key card", "key cards"),
    ("phone line", "phone lines"),
    ("trailer", "trailers"),
)
# (active, passive): "{owner} {active} {item} {value}", "{item} {value} {passive} {owner}"
VERBS = (
    ("was assigned", "was assigned to"),
    ("holds", "is held by"),
    ("received", "went to"),
    ("uses", "is used by"),
    ("registered", "was registered by"),
    ("keeps", "is kept by"),
    ("ordered", "was ordered by"),
    ("owns", "belongs to"),
)
FACT_SHAPES = (
    "{Owner} {active} {item} {value}.",
    "{Item} {value} {passive} {owner}.",
    "{Owner} {active} {item} {value} as well.",
    "Records show that {item} {value} {passive} {owner}.",
    "{Item} {value}, too, {passive} {owner}.",
    "In addition, {owner} {active} {item} {value}.",
    "The files note that {owner} {active} {item} {value}.",
)
QUESTION_SHAPES = (
    "Which {items} {passive_plural} {owner}?",
    "List every {item} that {passive} {owner}.",
    "What are all the {items} of {owner}?",
    "Name each of the {items} {owner} {active}.",
    "Give all the {items} that {passive_plural} {owner}.",
)
PLURAL = {"was": "were", "is": "are", "belongs": "belong"}  # other verbs: the same


def _capital(text: str) -> str:
    return text[0].upper() + text[1:]


def generated(rng: random.Random) -> ListRelation:
    """A list relation of an owner, an item and a verb, its facts in three to five wordings."""
    owner = rng.choice(OWNERS)
    item, items = rng.choice(ITEMS)
    active, passive = rng.choice(VERBS)
    first, _, rest = passive.partition(" ")
    words = {
        "owner": owner,
        "Owner": _capital(owner),
        "item": item,
        "Item": _capital(item),
        "items": items,
        "active": active,
        "passive": passive,
        "passive_plural": f"{PLURAL.get(first, first)} {rest}".strip(),
        "value": "{value}",
    }
    shapes = rng.sample(FACT_SHAPES, rng.randint(3, 5))
    facts = tuple(shape.format(**words) for shape in shapes)
    questions = tuple(shape.format(**words) for shape in QUESTION_SHAPES)
    return ListRelation(facts, questions, f"{_capital(owner)} {active} {items} {{values}}.")
