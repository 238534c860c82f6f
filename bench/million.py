"""One session holding a document of up to a million tokens, on the server's default settings:
ready, then answered, with the server's own memory sampled throughout, through the HTTP API.

Each length starts its own server (`longserve serve`, defaults: a session whose memory blocks
pass `session_ram_bytes`, 4 GiB, reads them into the disk tier; shorter ones stay in RAM;
`--session-ram-bytes` lowers it, e.g. to put a 128K document in the disk tier).
The document of a length: held-out prose (news, info, then licences, read again from the
start when all three run out), with --facts facts of one relation from bench/recall_tasks.py
and --keys pass keys, each of its own door ("The pass key of the Velorin door is 48213.
Remember it. ..."), all at seeded depths. A shorter length's document is the opening of a
longer one's prose with the same facts and keys at the same relative depths, so the
questions pair across lengths.

Asked on the session, one at a time, by chat through the openai SDK (greedy, the question
alone): every relation question and every pass key; with --adapter also through the answer
adapter. Then --decode-runs streamed completions of --decode-tokens tokens (ignore_eos) for the
decode step, each with the server's CPU seconds per token and the machine's dirty and writeback
bytes. One JSON line per length (ingest tokens/s, RssAnon idle/peak, RssFile peak, the disk
tier's bytes, the decode step, the questions right) and a last line pairing every length's rows
against the others' (McNemar's exact test):

    longserve bench million --lengths 32768 131072 1048576 --adapter recall
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import random
import statistics
from collections.abc import Callable, Iterator

import httpx
import psutil

from bench.disk_tier import Sampler, gauge, server_pid, status_kb
from bench.long_docs import ask
from bench.recall_chat import Asker, ask_all, upload
from bench.recall_corpus import digest, kind_paragraphs, load_token_counter
from bench.recall_report import compare_rows
from bench.recall_tasks import Fact, Names, Question, Trial, make_trial, plant_facts
from bench.server_process import served

HAYSTACK_KINDS = ("news", "info", "licenses")  # held out: never tuned on
KEY_FACT = (
    "The pass key of the {key} door is {value}. Remember it. {value} is the pass key of the"
    " {key} door."
)
KEY_QUESTION = "What is the pass key of the {key} door?"


def questions_of(seed: int, facts: int, keys: int) -> Trial:
    """The relation task's facts and questions (recall_tasks), and `keys` pass keys, one per
    band of depth."""
    trial = make_trial(f"million:{seed}", ("relation",), facts_of_relation=facts)
    rng = random.Random(f"million-keys:{seed}")
    names = Names(rng)
    names.used.update(q.expected[0] for q in trial.questions)
    planted, asked = list(trial.facts), list(trial.questions)
    for band in range(keys):
        key, value = names.name(), str(rng.randint(10_000, 99_999))
        while value in names.used:  # no key may answer a relation question, or another door
            value = str(rng.randint(10_000, 99_999))
        names.used.add(value)
        depth = (band + rng.random()) / keys
        planted.append(Fact(KEY_FACT.format(key=key, value=value), depth))
        asked.append(Question("passkey", (KEY_QUESTION.format(key=key),), (value,)))
    return Trial(tuple(planted), tuple(asked))


def haystack(seed: int) -> Iterator[str]:
    """Held-out paragraphs in a seeded order, the three kinds in turn, then again."""
    while True:
        for kind in HAYSTACK_KINDS:
            yield from kind_paragraphs(kind, f"million:{seed}")


def document(trial: Trial, seed: int, length: int, count: Callable[[list[str]], list[int]]) -> str:
    """About `length` tokens: the haystack's opening with the trial's facts planted."""
    budget = length - sum(count([f.sentence for f in trial.facts])) - 2 * len(trial.facts)
    paragraphs: list[str] = []
    total = 0
    source = haystack(seed)
    while True:
        batch = list(itertools.islice(source, 64))
        for paragraph, tokens in zip(batch, count(batch), strict=True):
            if total + tokens + 2 > budget:
                return "\n\n".join(plant_facts(paragraphs, trial.facts))
            paragraphs.append(paragraph)
            total += tokens + 2


@contextlib.contextmanager
def server(args: argparse.Namespace, env: dict[str, str]) -> Iterator[tuple]:
    """A fresh server: (base, httpx client, [(row, Asker)], model id, RSS sampler started)."""
    import openai

    serve_args = ["--device", args.device] + (["--model", args.model] if args.model else [])
    env = {"HF_HUB_OFFLINE": "1", **env}
    with served(None, serve_args=serve_args, ready_timeout=600, env=env) as base:
        http = httpx.Client(base_url=f"{base}/v1", timeout=args.timeout)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="bench", timeout=args.timeout)
        model = http.get("/models").json()["data"][0]["id"]
        ids = {"session": model}
        if args.adapter:
            ids[f"session+{args.adapter}"] = f"{model}:{args.adapter}"
        askers = [(name, Asker(client, id_, args.max_tokens)) for name, id_ in ids.items()]
        sampler = Sampler(server_pid(base), args.every)
        sampler.start()
        try:
            yield base, http, askers, model, sampler
        finally:
            sampler.stop()


def ask_session(askers: list, trial: Trial, session: str, line: dict) -> dict[str, dict]:
    """Every question of trial on session through each asker: {row: {question: right}}, and
    each row's score, seconds per question and answers into line."""
    rows = {}
    for name, asker in askers:
        answers = ask_all(asker, trial, lambda *_: None, {"session_id": session})
        right = {}
        for i, (question, answer) in enumerate(zip(trial.questions, answers, strict=True)):
            right[f"{question.task}:{i}"] = answer.correct
            if answer.error:
                line.setdefault("errors", []).append(answer.error[:200])
        rows[name] = right
        line[name] = {
            task: f"{sum(v for k, v in right.items() if k.startswith(task))}"
            f"/{sum(k.startswith(task) for k in right)}"
            for task in ("relation", "passkey")
        }
        line[f"{name}_s_per_question"] = round(
            sum(a.seconds for a in answers) / max(1, len(answers)), 1
        )
        line[f"{name}_first_s"] = round(answers[0].seconds, 1)
        line[f"{name}_answers"] = [a.text[:60] for a in answers]
    return rows


def memory_line(args: argparse.Namespace, line: dict, sampler: Sampler, idle: dict, read_at: int):
    line["rss_anon_idle"] = idle.get("RssAnon")
    line["rss_anon_peak"] = sampler.peak(1)
    line["rss_anon_peak_reading"] = max((s[1] for s in sampler.samples[:read_at]), default=0)
    line["rss_file_peak"] = sampler.peak(2)
    if args.series:
        line["samples"] = sampler.samples[:: max(1, int(args.series_every / args.every))]


def cell(args: argparse.Namespace, length: int, trial: Trial, text: str) -> tuple[dict, dict]:
    """One length on its own server, defaults: its JSON line, and {row: {question: right}}."""
    line: dict = {"bench": "million", "length": length, "document": digest(text)}
    env = {}  # the server's defaults, unless --session-ram-bytes is given (a disk cell)
    if args.session_ram_bytes is not None:
        line["session_ram_bytes"] = args.session_ram_bytes
        env["LONGSERVE_SESSION_RAM_BYTES"] = str(args.session_ram_bytes)
    with server(args, env) as (base, http, askers, model, sampler):
        idle = status_kb(sampler.pid)
        session, tokens, seconds = upload(http, {"strategy": "segments"}, text, args.timeout)
        read_at = len(sampler.samples)
        line |= {"tokens": tokens, "ingest_s": round(seconds, 1)}
        line["ingest_tok_s"] = round(tokens / seconds, 1)
        line["tier"] = http.get(f"/sessions/{session}").json()["memory"].get("tier")
        line["memory_disk_bytes"] = gauge(http, base, "longserve:memory_disk_bytes")
        rows = ask_session(askers, trial, session, line)
        line["decode"] = decode_runs(args, http, model, session, sampler.pid)
    memory_line(args, line, sampler, idle, read_at)
    return line, rows


def decode_runs(args: argparse.Namespace, http, model: str, session: str, pid: int) -> dict:
    """--decode-runs streamed completions of --decode-tokens on the session: each stream's
    first token and tokens/s, the server's CPU seconds per token decoded after the first (its
    work, against a wall clock others may share) and the machine's dirty and writeback bytes
    as it starts (the disk tier's pages being written out); the median tokens/s."""
    runs = []
    for _ in range(args.decode_runs):
        pages = meminfo_bytes(("Dirty", "Writeback"))
        first: list[float] = []  # the server's CPU seconds as the first token arrives
        step = ask(http, model, "", "segments", args.decode_tokens, "completions", session,
                   on_first=functools.partial(record_cpu_s, first, pid))  # fmt: skip
        run = {k: step[k] for k in ("ttft_s", "decode_tok_s", "completion_tokens")}
        decoded = step["completion_tokens"] - 1
        run["cpu_s_per_token"] = round((process_cpu_s(pid) - first[0]) / decoded, 4)
        runs.append(run | pages)
    rates = [r["decode_tok_s"] for r in runs if r["decode_tok_s"]]
    return {"decode_tok_s": statistics.median(rates) if rates else None, "runs": runs}


def meminfo_bytes(names: tuple[str, ...]) -> dict[str, int]:
    """These /proc/meminfo lines, in bytes."""
    out = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            name, _, rest = line.partition(":")
            if name in names:
                out[name] = int(rest.split()[0]) * 1024
    return out


def record_cpu_s(into: list[float], pid: int) -> None:
    into.append(process_cpu_s(pid))


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds pid has used, its threads together."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def switching(args: argparse.Namespace) -> None:
    """--sessions documents of --lengths[0] each, every one its own seed, read one after
    another into one server whose RAM holds --session-ram-bytes per session and
    --memory-ram-bytes over all (idle ones past it spill to disk); then each session asked in
    turn, its tier seen as the switch reaches it. A line per session, then the server's."""
    count = load_token_counter(args.model)
    length = args.lengths[0]
    env = {
        "LONGSERVE_SESSION_RAM_BYTES": str(args.session_ram_bytes or 8 * 1024**3),
        "LONGSERVE_MEMORY_RAM_BYTES": str(args.memory_ram_bytes),
    }
    line: dict = {"bench": "million", "sessions": args.sessions, "length": length, **env}
    with server(args, env) as (base, http, askers, model, sampler):
        idle = status_kb(sampler.pid)
        held = []
        for s in range(args.sessions):
            trial = questions_of(args.seed + s, args.facts, args.keys)
            text = document(trial, args.seed + s, length, count)
            session, tokens, seconds = upload(http, {"strategy": "segments"}, text, args.timeout)
            own: dict = {"session": s, "document": digest(text), "tokens": tokens}
            own["ingest_s"] = round(seconds, 1)
            own["ingest_tok_s"] = round(tokens / seconds, 1)
            held.append((session, trial, own))
        read_at = len(sampler.samples)
        for session, trial, own in held:
            own["tiers_at_switch"] = {
                i: http.get(f"/sessions/{sid}").json()["memory"].get("tier")
                for i, (sid, _, _) in enumerate(held)
            }
            ask_session(askers, trial, session, own)
            print(json.dumps({"bench": "million", **own}), flush=True)
        line["memory_disk_bytes"] = gauge(http, base, "longserve:memory_disk_bytes")
        line["sessions_on_disk"] = gauge(http, base, "longserve:sessions_on_disk")
    memory_line(args, line, sampler, idle, read_at)
    print(json.dumps(line), flush=True)


def run(args: argparse.Namespace) -> None:
    count = load_token_counter(args.model)
    trial = questions_of(args.seed, args.facts, args.keys)
    rows: dict[str, dict[str, bool]] = {}
    for length in args.lengths:
        text = document(trial, args.seed, length, count)
        try:
            line, cell_rows = cell(args, length, trial, text)
        except Exception as exc:  # a failed length is reported; the rest still run
            line, cell_rows = {"bench": "million", "length": length}, {}
            line["error"] = f"{type(exc).__name__}: {exc}"[:400]
        rows |= {f"{length}/{name}": right for name, right in cell_rows.items()}
        print(json.dumps(line), flush=True)
    table = compare_rows(rows)
    print(json.dumps({"bench": "million", "summary": table, "args": vars(args)}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 1048576])
    parser.add_argument("--facts", type=int, default=16, help="facts of the relation asked")
    parser.add_argument("--keys", type=int, default=10, help="pass keys, one per door")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument(
        "--decode-runs", type=int, default=3, help="streams of --decode-tokens, the median kept"
    )
    parser.add_argument("--adapter", help="also ask through this answer adapter (e.g. recall)")
    parser.add_argument("--every", type=float, default=0.5, help="seconds between RSS samples")
    parser.add_argument("--series", action="store_true", help="print the RSS samples too")
    parser.add_argument(
        "--series-every", type=float, default=10.0, help="seconds between printed samples"
    )
    parser.add_argument("--device", default="auto", help="the server's --device")
    parser.add_argument("--model", default=None, help="the server's --model (default: embedded)")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per request")
    parser.add_argument(
        "--sessions", type=int, default=1, help="more than 1: that many sessions of one length"
    )
    parser.add_argument(
        "--session-ram-bytes",
        type=int,
        help="a session's RAM for memory blocks (default: the server's, 4 GiB; with --sessions, "
        "8 GiB); one length under it goes to the disk tier, e.g. 128K tokens under 1 GiB",
    )
    parser.add_argument("--memory-ram-bytes", type=int, default=6 * 1024**3)
    args = parser.parse_args(argv)
    if min(args.facts, args.keys, args.sessions, args.decode_runs) < 1:
        parser.error("--facts, --keys, --sessions and --decode-runs must be >= 1")
    switching(args) if args.sessions > 1 else run(args)


if __name__ == "__main__":
    main()
