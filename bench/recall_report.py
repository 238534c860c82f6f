"""How `bench.recall` compares its modes: Wilson intervals per row and McNemar's exact test
between two rows on the questions both were asked.

A row is one mode (with its strategy, for inline and session) at one length; its answers are
keyed by question (`kind:trial:index`), and every mode of a run is asked the same questions, so
two rows pair question for question. McNemar's exact test looks only at the discordant pairs:
under "the two modes are equally good" each of them is as likely to favour either mode, so the
count one mode wins is Binomial(discordant, 1/2), and p is the two-sided tail of what was seen.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from bench.recall_tasks import wilson

if TYPE_CHECKING:
    from bench.recall_chat import Answer


def mcnemar_exact(won: int, lost: int) -> float:
    """Two-sided exact McNemar p-value: won questions one mode answered and the other did not,
    lost the reverse. p = 2 * P(X <= min(won, lost)), X ~ Binomial(won + lost, 1/2), at most 1;
    1 when no pair is discordant."""
    n = won + lost
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(won, lost) + 1))
    return min(1.0, 2 * tail / 2**n)


def paired(a: dict[str, bool], b: dict[str, bool]) -> tuple[int, int, int]:
    """On the questions both rows answered: (a right and b wrong, a wrong and b right, pairs)."""
    shared = a.keys() & b.keys()
    won = sum(a[q] and not b[q] for q in shared)
    lost = sum(b[q] and not a[q] for q in shared)
    return won, lost, len(shared)


def compare_rows(rows: dict[str, dict[str, bool]]) -> dict[str, dict]:
    """For each row (name -> {question: correct}): n, correct, the Wilson 95 % interval and, for
    every other row, the paired counts and McNemar's exact p ("vs")."""
    table = {}
    for name, answers in rows.items():
        correct = sum(answers.values())
        low, high = wilson(correct, len(answers))
        vs = {}
        for other, their in rows.items():
            if other != name:
                won, lost, pairs = paired(answers, their)
                vs[other] = {
                    "won": won,
                    "lost": lost,
                    "pairs": pairs,
                    "p": mcnemar_exact(won, lost),
                }
        table[name] = {
            "n": len(answers),
            "correct": correct,
            "accuracy": round(correct / len(answers), 4) if answers else None,
            "ci_low": round(low, 4),
            "ci_high": round(high, 4),
            "vs": vs,
        }
    return table


def row_text(length: int, name: str, row: dict) -> str:
    """One readable line: `32768 session/segments 30/64 (0.35-0.59) | vs reference +9 -2 p=0.065
    ...`, p to three figures."""
    head = f"{length} {name} {row['correct']}/{row['n']} ({row['ci_low']:.2f}-{row['ci_high']:.2f})"
    pairs = [f"vs {o} +{v['won']} -{v['lost']} p={v['p']:.3g}" for o, v in row["vs"].items()]
    return " | ".join([head, *pairs])


def cell_record(
    length: int,
    kind: str,
    task: str,
    mode: str,
    strategy: str | None,
    answers: list[Answer],
    info: dict,
    reads: list[float] | None,
) -> dict:
    """One cell's JSON line: correct/n, Wilson interval, timing, misses, the server's info."""
    correct = sum(a.correct for a in answers)
    low, high = wilson(correct, len(answers))
    timed = [a.seconds for a in answers if a.error is None]
    errors = [a.error for a in answers if a.error]
    record = {
        "bench": "recall",
        "length": length,
        "kind": kind,
        "task": task,
        "mode": mode,
        "strategy": strategy,
        "n": len(answers),
        "correct": correct,
        "accuracy": round(correct / len(answers), 4) if answers else None,
        "ci_low": round(low, 4),
        "ci_high": round(high, 4),
        "seconds_per_question": round(sum(timed) / len(timed), 2) if timed else None,
        "context_tokens": round(sum(a.context_tokens for a in answers) / len(answers)),
        "max_prompt_tokens": max(a.prompt_tokens for a in answers),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "paraphrased": {
            "n": sum(a.paraphrased for a in answers),
            "correct": sum(a.paraphrased and a.correct for a in answers),
        },
        "misses": [
            {"expected": list(a.expected), "answer": a.text[:160]} for a in answers if not a.correct
        ][:3],
        **info,
    }
    if mode == "session" and reads:
        record["read_seconds_per_document"] = round(sum(reads) / len(reads), 1)
    return record
