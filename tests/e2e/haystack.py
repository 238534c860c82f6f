"""A long generated document with facts planted at chosen depths, for real-model recall tests.

The filler is prose of varied sentences (seeded, so every run reads the same text), about
everyday places and things that never mention what the facts are about, so a fact is the only
sentence that can answer its question.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

SUBJECTS = (
    "The old baker",
    "A tired student",
    "The river ferry",
    "Our neighbour's dog",
    "The choir",
    "A travelling salesman",
    "The village council",
    "My grandmother",
    "The night train",
    "A flock of geese",
    "The school librarian",
    "The orchard keeper",
    "A young painter",
    "The museum guide",
    "The fishing fleet",
    "A quiet accountant",
    "The garden club",
    "The mountain guide",
    "A street musician",
    "The weather station",
)
VERBS = (
    "walked past",
    "repaired",
    "painted",
    "talked about",
    "counted",
    "photographed",
    "cleaned",
    "measured",
    "forgot about",
    "visited",
    "admired",
    "described",
    "sold",
    "carried",
    "waited near",
    "borrowed",
    "watered",
    "studied",
    "sketched",
    "complained about",
)
OBJECTS = (
    "the wooden bridge",
    "a basket of apples",
    "the red bicycle",
    "the clock tower",
    "a pile of letters",
    "the stone wall",
    "the greenhouse",
    "a box of candles",
    "the narrow staircase",
    "the village square",
    "a pair of boots",
    "the bakery window",
    "the kitchen table",
    "a stack of maps",
    "the bell of the chapel",
    "the orchard gate",
    "a jar of honey",
    "the old piano",
    "the lighthouse lamp",
    "a bundle of firewood",
)
TIMES = (
    "on a rainy Monday",
    "before breakfast",
    "late in the evening",
    "during the spring fair",
    "after the long winter",
    "at noon",
    "on the first day of autumn",
    "while the kettle boiled",
    "just before the storm",
    "on a quiet Sunday",
    "in the early morning",
    "after supper",
)
CLAUSES = (
    "and nobody seemed to mind",
    "because the weather had finally cleared",
    "while the children played outside",
    "although it took most of the afternoon",
    "as the church bells were ringing",
    "and then went home to rest",
    "so that the market could open on time",
    "which surprised everyone a little",
    "before anyone else had woken up",
    "and wrote a short note about it",
)


def filler_sentence(rng: random.Random) -> str:
    sentence = (
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TIMES)}"
    )
    if rng.random() < 0.6:
        sentence += f" {rng.choice(CLAUSES)}"
    return sentence + "."


def prose(sentences: Sequence[str]) -> str:
    """Sentences in paragraphs of six."""
    return "\n\n".join(" ".join(sentences[i : i + 6]) for i in range(0, len(sentences), 6))


def haystack(
    count_tokens: Callable[[str], int],
    n_tokens: int,
    facts: Sequence[tuple[float, str]],
    seed: int = 0,
) -> str:
    """About n_tokens of filler with each (depth, sentence) fact planted at that depth (0..1),
    each as a paragraph of its own."""
    rng = random.Random(seed)
    sample = [filler_sentence(rng) for _ in range(200)]
    per_sentence = count_tokens(prose(sample)) / len(sample)
    n_sentences = max(1, int((n_tokens - sum(count_tokens(f) for _, f in facts)) / per_sentence))
    rng = random.Random(seed)
    sentences = [filler_sentence(rng) for _ in range(n_sentences)]
    cuts = sorted((int(depth * n_sentences), fact) for depth, fact in facts)
    parts, start = [], 0
    for cut, fact in cuts:
        parts.append(prose(sentences[start:cut]))
        parts.append(fact)
        start = cut
    parts.append(prose(sentences[start:]))
    return "\n\n".join(p for p in parts if p)


def reference_manual(
    count_tokens: Callable[[str], int],
    n_tokens: int,
    facts: Sequence[tuple[float, str]],
) -> str:
    """About n_tokens of real prose: sections of Python's language reference (pydoc_data,
    shipped with CPython), with each (depth, sentence) fact a paragraph of its own at that
    depth (0..1)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    paragraphs = [
        " ".join(p.split())
        for name in sorted(topics)
        for p in topics[name].split("\n\n")
        if len(p.split()) > 8
    ]
    body, total = [], 0
    for paragraph in paragraphs:
        if total >= n_tokens:
            break
        body.append(paragraph)
        total += count_tokens(paragraph) + 1
    for depth, fact in sorted(facts, reverse=True):
        body.insert(int(depth * len(body)), fact)
    return "\n\n".join(body)
