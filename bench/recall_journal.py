"""`bench recall --journal FILE`: every answered unit (one document asked in one mode and
strategy) appended to a JSON-lines file as it completes, and reused by a later run that would
send the server exactly the same thing.

A unit's key is a sha256 of what decides its answers: the row, what the mode sends (the
reference text, the tail, the document with the RAG budget, the document with the memory knobs),
the questions' turns and expected values, the model id, max_tokens and the adapters asked. The
same reference document is built at every length (bench/recall_corpus.py), so its unit is
answered once per run and reused at every length; a run stopped at a session's end goes on from
the last unit it wrote. A unit holding a failed request is asked again. Each line also names the
host (CPU model and the vector flags that change kernels) and the commit that answered it, and
the summary lists every host and commit that answered what it reports.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path

from bench.recall_chat import Answer
from bench.recall_tasks import Trial

VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def host() -> str:
    """The CPU's model name and the vector flags that choose kernels, e.g. "AMD EPYC ... avx2"."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            field, _, value = line.partition(":")
            if field.strip() == "model name":
                name = value.strip()
            elif field.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return " ".join([name, *[f for f in VECTOR_FLAGS if f in flags]])


def commit() -> str | None:
    """The repository's HEAD (with "+dirty" when its tracked files changed), or None."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "diff", "--quiet", "HEAD"], capture_output=True
        ).returncode
    except OSError:
        return None
    return (head + ("+dirty" if dirty else "")) if head else None


def unit_key(row: str, sent: dict, trial: Trial, model: str, max_tokens: int) -> str:
    """The sha256 of everything that decides a unit's answers (`sent`: what the mode sends
    besides the questions, e.g. {"text": ..., "memory": {...}})."""
    questions = [[q.task, list(q.turns), list(q.expected)] for q in trial.questions]
    blob = json.dumps(
        {"row": row, "sent": sent, "questions": questions, "model": model, "max": max_tokens},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def to_json(answer: Answer) -> dict:
    return {**dataclasses.asdict(answer), "expected": list(answer.expected)}


def from_json(record: dict) -> Answer:
    return Answer(**{**record, "expected": tuple(record["expected"])})


class Journal:
    """The units of earlier runs (key -> line), and the file new ones are appended to."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.units: dict[str, dict] = {}
        self.host, self.commit = host(), commit()
        self.reused = self.written = 0
        if self.path.exists():
            for number, line in enumerate(self.path.read_text().splitlines(), 1):
                try:
                    unit = json.loads(line)
                    self.units[unit["key"]] = unit
                except (json.JSONDecodeError, KeyError, TypeError):
                    # a line cut by a stopped run: its unit is asked again
                    print(f"journal {self.path}:{number}: unreadable, ignored", flush=True)

    def get(self, key: str) -> tuple[dict[str, list[Answer]], float | None] | None:
        """A unit's answers by row and its read seconds, unless it is missing or failed."""
        unit = self.units.get(key)
        if unit is None or any(a.get("error") for rows in unit["rows"].values() for a in rows):
            return None
        self.reused += 1
        unit["used"] = True
        rows = {row: [from_json(a) for a in answers] for row, answers in unit["rows"].items()}
        return rows, unit.get("read_seconds")

    def put(
        self, key: str, where: dict, rows: dict[str, list[Answer]], read_seconds: float | None
    ) -> None:
        """Appends one answered unit (`where`: its length, kind, trial, mode, strategy and
        document digest, for a reader) and flushes it to disk."""
        unit = {
            "key": key,
            **where,
            "rows": {row: [to_json(a) for a in answers] for row, answers in rows.items()},
            "read_seconds": read_seconds,
            "host": self.host,
            "commit": self.commit,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(unit) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.units[key] = {**unit, "used": True}
        self.written += 1

    def provenance(self) -> dict:
        """For the summary: units reused and written, and every host and commit behind them."""
        used = [u for u in self.units.values() if u.get("used")]
        return {
            "journal": str(self.path),
            "units_reused": self.reused,
            "units_written": self.written,
            "hosts": sorted({u["host"] for u in used}),
            "commits": sorted({str(u["commit"]) for u in used}),
        }


def rows_of(units: list[dict], length: int) -> tuple[dict[str, dict[str, bool]], dict[str, str]]:
    """{row: {question: correct}} at one length, only over the documents every row of that
    length answered, so the rows compare on the same questions; and {row: its seconds per
    question (and, for a session, per document read)} over them."""
    at = [u for u in units if u["length"] == length]
    answered: dict[str, dict[str, dict]] = {}  # row -> document -> unit
    for unit in at:
        for row in unit["rows"]:
            name = f"{row}/{unit['strategy'] or '-'}"
            answered.setdefault(name, {})[f"{unit['kind']}:{unit['trial']}"] = unit
    shared = set.intersection(*(set(docs) for docs in answered.values())) if answered else set()
    out: dict[str, dict[str, bool]] = {}
    timing: dict[str, str] = {}
    for name, docs in answered.items():
        row = name.rsplit("/", 1)[0]
        answers = [a for doc in sorted(shared) for a in docs[doc]["rows"][row]]
        out[name] = {a["question"]: a["correct"] for a in answers if not a.get("error")}
        seconds = [a["seconds"] for a in answers if not a.get("error")]
        reads = [docs[d]["read_seconds"] for d in shared if docs[d].get("read_seconds")]
        timing[name] = f"{sum(seconds) / max(1, len(seconds)):.1f} s/question" + (
            f", {sum(reads) / len(reads):.0f} s/read" if reads else ""
        )
    return out, timing


def report(path: str | os.PathLike) -> list[str]:
    """What a journal holds, read without a server: per length, each row's correct/n (Wilson
    interval) with McNemar's exact test against every other row, on the documents every row
    answered; questions expecting several values (multivalue) counted apart too."""
    from bench.recall_report import compare_rows, row_text

    units: dict[str, dict] = {}
    for line in Path(path).read_text().splitlines():
        try:
            unit = json.loads(line)
            units[unit["key"]] = unit
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    listed = list(units.values())
    lengths = sorted({u["length"] for u in listed})
    out = []
    for length in lengths:
        here = [u for u in listed if u["length"] == length]
        # the reference document is the same at every length: its unit, answered at one
        # length, is reused at the others and journaled once
        held = {(u["kind"], u["trial"]) for u in here if u["mode"] == "reference"}
        here += [
            {**u, "length": length}
            for u in listed
            if u["mode"] == "reference" and (u["kind"], u["trial"]) not in held
        ]
        rows, timing = rows_of(here, length)
        shared = {q.rsplit(":", 1)[0] for answers in rows.values() for q in answers}
        out.append(f"{length}: {len(shared)} documents answered in every row")
        out += [row_text(length, name, row) for name, row in compare_rows(rows).items()]
        out.append(f"{length} timing: " + "; ".join(f"{n} {t}" for n, t in timing.items()))
        several = multivalue_questions(here)
        listed_rows = {
            name: list_answers(here, name, several & answers.keys())
            for name, answers in rows.items()
        }
        out.append(
            f"{length} multivalue (whole lists; values found; numbers invented): "
            + ", ".join(f"{n} {w}/{t}; {f}/{v}; {i}" for n, (w, t, f, v, i) in listed_rows.items())
        )
    out.append(
        "hosts: "
        + "; ".join(sorted({u["host"] for u in listed}))
        + " | commits: "
        + ", ".join(sorted({str(u["commit"]) for u in listed}))
    )
    return out


def list_answers(units: list[dict], name: str, asked: set[str]) -> tuple[int, int, int, int, int]:
    """A row's multivalue answers among `asked`: (right whole, asked, values found, values
    expected, numbers of five or more digits given that were not expected)."""
    row, _, strategy = name.rpartition("/")
    whole = found = values = invented = 0
    for unit in units:
        if (unit["strategy"] or "-") != strategy or row not in unit["rows"]:
            continue
        for a in unit["rows"][row]:
            if a["question"] not in asked:
                continue
            given = set(re.findall(r"\d{5,}", a["text"]))
            whole += a["correct"]
            found += len(given & set(a["expected"]))
            values += len(a["expected"])
            invented += len(given - set(a["expected"]))
    return whole, len(asked), found, values, invented


def multivalue_questions(units: list[dict]) -> set[str]:
    """The questions whose answer must hold several values."""
    return {
        a["question"]
        for u in units
        for answers in u["rows"].values()
        for a in answers
        if len(a["expected"]) > 1
    }


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m bench.recall_journal",
        description="Print a `bench recall --journal` file's paired rows, without a server.",
    )
    parser.add_argument("journal", help="the JSON-lines journal a recall run wrote")
    print("\n".join(report(parser.parse_args().journal)))
