"""Reliability soak: honest tenants uploading and chatting beside hostile ones, while the memory
service and Redis are killed (-9) and restarted; every acknowledged document and turn is then
looked up in the store, and the store's bytes and every process's memory are sampled throughout.

Everything runs on loopback, started here (bench/soak_processes.py): Redis (one server, or with
--cluster a 3-primary Redis Cluster with a replica each, AOF fsync always; none with
--embedded-store), `longserve memory-store` on it (or on its embedded backend), and --replicas
`longserve serve` replicas on the memory service (the embedded model unless --model), started
with one API key per client, so that every client is a tenant of its own.

--clients honest clients each loop: create a session, upload a short document of its own and
wait until it is read, then chat --turns turns resending the conversation (greedy,
--max-tokens, streamed: the time to the first token, from the first try, is the TTFT). A
refused step (any non-200) is counted by status and retried after a pause, as a client would.
Each keeps its --keep-sessions latest sessions; an older one is checked (below) and deleted, so
that the honest load holds a steady amount of data.

--hostile hostile clients loop over attacks (bench/soak_hostile.py: large metadata, stored
responses with large tools and inputs, a 24 MB prompt, floods, crafted PDFs, create-upload-
delete loops, malformed ids), their answers counted by status; a 5xx or a broken connection
is reported as a defect. With --alternate SECONDS they attack only in every other block of
SECONDS (quiet first), and the honest TTFTs are also reported by the phase each chat started
in, with the hostile phase's p99 over the quiet one's: both phases measured on the same
servers in the same run, so the machine's drift over the run falls on both (decision 061).

Every --interval seconds (unless --no-chaos) the chaos task kills one thing with SIGKILL and
restarts it: the memory service, then Redis (on a cluster: a primary, which its replica
replaces; the old primary rejoins as a replica), in turn. Every --sample-seconds the store's
bytes and the processes' RSS are sampled (bench/soak_sampling.py).

Acknowledged means: a document the API reported `ready`, a chat answered 200 to its end. Each
is checked in the store directly (server/sessions/records.py): a document must be there, not
failed, with its text (a status save lost to an outage leaves it `queued`, and a restore reads
it again); a turn must be there with the same question and answer. One JSON line: requests and
errors by status, the honest TTFT's percentiles, the hostile answers and defects, chaos events,
acknowledged and lost documents and turns, the samples and each curve's flatness after warm-up.

Run from a checkout (it uses the tests' Redis process helpers); the same --seed and --clients
give the same honest load with and without hostile tenants:

    longserve bench soak --seconds 240 --clients 4 --replicas 2 --cluster
    longserve bench soak --seconds 1800 --clients 4 --hostile 2 --no-chaos --series hostile.csv
    longserve bench soak --seconds 1800 --clients 4 --hostile 2 --no-chaos --alternate 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import httpx

from bench.server_process import model_args, served
from bench.soak_honest import Ledger, check_when_up, client
from bench.soak_hostile import ATTACKS, Payloads, defects, hostile_client
from bench.soak_processes import MemoryService, Redis
from bench.soak_sampling import Sampler
from memory_store.client import http_client


async def chaos(
    redis: Redis | None, service: MemoryService, interval: float, end: float, ledger: Ledger
) -> None:
    which = 0
    while time.monotonic() + interval < end:
        await asyncio.sleep(interval)
        if which % 2 == 0 or redis is None:
            service.kill()
            ledger.chaos.append("memory service killed")
            await asyncio.sleep(3)
            await asyncio.to_thread(service.start)
        else:
            await asyncio.to_thread(redis.kill_one, ledger.chaos)
        which += 1


async def sampling(sampler: Sampler, every: float, done: asyncio.Event) -> None:
    while not done.is_set():
        await asyncio.to_thread(sampler.sample)
        with suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), every)
    await asyncio.to_thread(sampler.sample)


async def alternate(
    every: float, end: float, ledger: Ledger, start_hostile: Callable[[float], list[asyncio.Task]]
) -> None:
    """Blocks of `every` seconds, quiet then hostile in turn: the hostile tenants attack only
    in theirs, and are cut off at its end (a request then in flight is dropped, not counted),
    so that each honest chat's TTFT is counted in the phase it started in. The two phases
    then share the machine's drift over the run."""
    block = 0
    while (now := time.monotonic()) < end:
        until = min(end, now + every)
        ledger.phase = "hostile" if block % 2 else "quiet"
        tasks = start_hostile(until) if ledger.phase == "hostile" else []
        await asyncio.sleep(until - now)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(asyncio.CancelledError):
                await task  # a bug in an attack fails the run rather than hiding
        block += 1


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    ordered = sorted(values)

    def rank(q: float) -> float | None:  # nearest rank
        return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 3) if ordered else None

    return {"n": len(ordered), "p50": rank(0.5), "p99": rank(0.99), "max": rank(1.0)}


async def run(args: argparse.Namespace) -> dict:
    random.seed(args.seed)
    ledger = Ledger()
    honest_keys = [f"soak-honest-{i}" for i in range(args.clients)]
    hostile_keys = [f"soak-hostile-{i}" for i in range(args.hostile)]
    with tempfile.TemporaryDirectory(prefix="longserve-soak-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        redis = None
        directories = {}
        if args.embedded_store:
            directories["memory-store"] = root / "memory-store"
        else:
            directories["redis"] = root / "redis"
            directories["redis"].mkdir()
            redis = Redis(args.cluster, directories["redis"])
            stack.callback(redis.stop)
        service = MemoryService(
            redis.url if redis else None, root / "memory-store.log", root / "memory-store"
        )
        service.start()
        stack.callback(service.kill)
        # the replicas split the machine's cores (decision 061: sharing them all, their
        # OpenMP threads spin against each other)
        threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
        serve = ["--memory-store", service.url, "--threads", str(threads), *model_args(args)]
        serve += [arg for key in honest_keys + hostile_keys for arg in ("--api-key", key)]
        bases = [
            stack.enter_context(served(None, serve_args=serve, ready_timeout=600))
            for _ in range(args.replicas)
        ]
        auth = {"authorization": f"Bearer {honest_keys[0]}"} if honest_keys else {}
        model = httpx.get(f"{bases[0]}/v1/models", headers=auth).json()["data"][0]["id"]
        roles = {service.port: "memory-store"}
        roles |= {int(base.rsplit(":", 1)[1]): f"replica{i}" for i, base in enumerate(bases)}
        if redis is not None:
            ports = redis.ports()
            roles |= {port: "redis" if len(ports) == 1 else f"redis{i}" for i, port in
                      enumerate(ports)}  # fmt: skip
        sampler = Sampler(roles, directories, redis.ports if redis else None)
        payloads = Payloads.build(model) if args.hostile else None
        store = http_client(service.url, timeout_s=30)
        started = time.monotonic()
        end = started + args.seconds
        done = asyncio.Event()
        watcher = asyncio.create_task(sampling(sampler, args.sample_seconds, done))

        def start_hostile(until: float) -> list[asyncio.Task]:
            return [
                asyncio.create_task(hostile_client(i, bases[i % len(bases)], key, model,
                                                   payloads, args.attacks, ledger.hostile, until))
                for i, key in enumerate(hostile_keys)
                if payloads is not None
            ]  # fmt: skip

        honest = [
            client(i, bases[i % len(bases)], model, args, ledger, store, end)
            for i in range(args.clients)
        ]
        hostile = []
        if args.alternate:
            honest.append(alternate(args.alternate, end, ledger, start_hostile))
        else:
            hostile = start_hostile(end)
        if not args.no_chaos:
            honest.append(chaos(redis, service, args.interval, end, ledger))
        await asyncio.gather(*honest)
        # A hostile request under way at the end may finish (it is counted), briefly.
        finished, late = await asyncio.wait(hostile, timeout=60) if hostile else (set(), set())
        for task in late:
            task.cancel()
        for task in finished:
            task.result()  # a bug in an attack fails the run rather than hiding
        seconds = time.monotonic() - started
        done.set()
        await watcher
        if service.proc is None or service.proc.poll() is not None:
            service.start()
        try:
            for sid, kept in ledger.unchecked.items():
                ledger.checked += await check_when_up(store, sid, kept)
        finally:
            await store.close()
        if args.series:
            sampler.write_csv(Path(args.series))
    errors = {k: v for k, v in ledger.statuses.items() if not k.endswith(" 200")}
    redis_kind = "cluster" if args.cluster else "single"
    if args.embedded_store:
        redis_kind = "none (embedded store)"
    return {
        "bench": "soak",
        "redis": redis_kind,
        "replicas": args.replicas,
        "threads_per_replica": threads,
        "clients": args.clients,
        "hostile": args.hostile,
        "attacks": args.attacks if args.hostile else [],
        "seed": args.seed,
        "seconds": round(seconds, 1),
        "requests": sum(ledger.statuses.values()),
        "errors_by_status": dict(sorted(errors.items())),
        "honest_ttft_s": percentiles(ledger.ttft),
        **phases(ledger),
        "hostile_requests": sum(ledger.hostile.values()),
        "hostile_by_status": dict(sorted(ledger.hostile.items())),
        "hostile_defects": defects(ledger.hostile),
        "chaos": ledger.chaos if not args.no_chaos else "off",
        **{k: ledger.checked[k] for k in ("documents_acknowledged", "turns_acknowledged")},
        **{k: ledger.checked[k] for k in ("documents_lost", "turns_lost")},
        "flatness": sampler.flatness(),
        "samples": sampler.samples,
    }


def phases(ledger: Ledger) -> dict[str, Any]:
    """With --alternate: the honest TTFTs of each phase, and the hostile phase's p99 over the
    quiet one's (the same servers, the same run)."""
    if set(ledger.ttft_by_phase) <= {"all"}:
        return {}
    by_phase = {phase: percentiles(values) for phase, values in ledger.ttft_by_phase.items()}
    quiet, hostile = by_phase.get("quiet", {}), by_phase.get("hostile", {})
    ratio = None
    if quiet.get("p99") and hostile.get("p99"):
        ratio = round(hostile["p99"] / quiet["p99"], 2)
    return {"honest_ttft_s_by_phase": by_phase, "p99_ttft_hostile_over_quiet": ratio}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="longserve bench soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--clients", type=int, default=4, help="honest clients")
    parser.add_argument("--hostile", type=int, default=0, help="hostile clients")
    parser.add_argument(
        "--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS), help="what they send"
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per replica (default: cores / replicas)",
    )
    parser.add_argument("--turns", type=int, default=3, choices=[1, 2, 3])
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--keep-sessions", type=int, default=4, help="per honest client")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between kills")
    parser.add_argument("--no-chaos", action="store_true", help="kill nothing")
    parser.add_argument(
        "--alternate",
        type=float,
        default=None,
        metavar="SECONDS",
        help="hostile tenants only in every other block of SECONDS (quiet first); TTFTs by phase",
    )
    parser.add_argument("--sample-seconds", type=float, default=10.0)
    parser.add_argument("--series", default=None, help="also write the samples to this CSV")
    parser.add_argument("--seed", type=int, default=0)
    store = parser.add_mutually_exclusive_group()
    store.add_argument("--cluster", action="store_true", help="Redis Cluster, 3 primaries")
    store.add_argument(
        "--embedded-store", action="store_true", help="the memory service's embedded backend"
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
