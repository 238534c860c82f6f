"""`longserve bench recall`'s command line (bench/recall.py says what the bench does)."""

from __future__ import annotations

import argparse
import json

from bench.recall_corpus import DEFAULT_HELD_OUT, HELD_OUT_KINDS, KIND_SETS, TUNED_KINDS
from bench.recall_tasks import DEFAULT_TASKS, TASKS
from bench.server_process import add_server_arguments

BASELINES = ("reference", "truncate", "rag")
MEMORY_MODES = ("inline", "session")
STRATEGIES = ("segments", "tokens", "neurocache", "larimar")
FRAMELESS = ("larimar",)  # no memory blocks: memory_dtype is not one of its knobs


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """`bench recall`'s arguments, checked; args.variants and args.kind_set filled in."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument(
        "--questions", type=int, default=56, help="at least this many per mode and length"
    )
    parser.add_argument(
        "-n", "--samples", type=int, help="trials per length and kind (default: for --questions)"
    )
    parser.add_argument("--n-large", type=int, help="trials at --large-from and above")
    parser.add_argument("--large-from", type=int, default=131072)
    parser.add_argument("--modes", nargs="+", choices=BASELINES + MEMORY_MODES)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(DEFAULT_TASKS))
    parser.add_argument(
        "--held-out",
        action="store_true",
        help=f"judge on the kinds kept aside (default {' '.join(DEFAULT_HELD_OUT)}); never tune",
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=list(KIND_SETS),
        help=f"text kinds (default: {' '.join(TUNED_KINDS)}; held-out ones need --held-out)",
    )
    parser.add_argument("--facts", type=int, default=8, help="relation: facts per document")
    parser.add_argument("--keys", type=int, default=3, help="multikey: facts asked one by one")
    parser.add_argument("--values", type=int, default=3, help="multivalue: values of the key")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--reserve",
        type=int,
        default=512,
        help="window tokens kept for template, question and answer (reference, truncate)",
    )
    parser.add_argument("--rag-tokens", type=int, default=3072, help="retrieved, per turn")
    parser.add_argument("--rag-chunk-tokens", type=int, default=256)
    parser.add_argument(
        "--knobs",
        type=json.loads,
        default={},
        help="memory knobs (JSON) for inline and session, e.g. '{\"prior_k\": 4}'",
    )
    parser.add_argument(
        "--memory-dtypes",
        nargs="+",
        choices=("auto", "model", "float16", "int8"),
        help="memory_dtype of each inline and session cell, measured in turn (e.g. float16 int8)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        metavar="NAME=JSON",
        help="memory knobs of each inline and session cell, measured in turn on the same "
        'documents and questions (e.g. dense=\'{"prior_match": "dense"}\'); rows strategy@NAME',
    )
    parser.add_argument(
        "--adapter",
        nargs="+",
        help="also ask every question through these answer adapters (model <id>:NAME), on the "
        "same sessions and contexts: rows named mode+NAME",
    )
    parser.add_argument(
        "--serve-adapter",
        nargs="+",
        metavar="NAME=PATH",
        help="adapter files the started server serves besides its shipped ones (its --adapter)",
    )
    parser.add_argument(
        "--journal",
        metavar="FILE",
        help="append each answered unit (a document in one mode) to FILE and reuse the units "
        "an earlier run answered with exactly the same request (bench/recall_journal.py)",
    )
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    args.modes = args.modes or list(BASELINES + MEMORY_MODES)
    given = [v for v in (args.samples, args.n_large) if v is not None]
    if min(given + [args.keys, args.values, args.facts, args.questions]) < 1:
        parser.error("-n, --n-large, --questions, --facts, --keys and --values must be >= 1")
    args.kinds = args.kinds or list(DEFAULT_HELD_OUT if args.held_out else TUNED_KINDS)
    wrong_set = [k for k in args.kinds if (k in HELD_OUT_KINDS) != args.held_out]
    if wrong_set:
        parser.error(
            f"{wrong_set}: held-out kinds only with --held-out, and only they"
            " (a run judges on the held-out set or tunes on the other, never both)"
        )
    args.kind_set = "held_out" if args.held_out else "tuned"
    args.variants = variants(parser, args)
    return args


def variants(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, dict]:
    """The cells' knob variants by name: --memory-dtypes' (named by the dtype) or --variants'."""
    if args.memory_dtypes and args.variants:
        parser.error("--memory-dtypes or --variants, not both")
    if args.memory_dtypes:
        return {d: {"memory_dtype": d} for d in args.memory_dtypes}
    out: dict[str, dict] = {}
    for given in args.variants or []:
        name, sep, text = given.partition("=")
        try:
            knobs = json.loads(text) if sep and name else None
        except json.JSONDecodeError:
            knobs = None
        if not isinstance(knobs, dict) or "@" in name or name in out:
            parser.error(f"--variants {given!r}: NAME=JSON, a unique name and a JSON object")
        out[name] = knobs
    return out
