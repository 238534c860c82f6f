"""The soak's honest tenants (bench/soak.py): each its own API key, creating sessions,
uploading a short document, chatting on it with streamed answers (the TTFT of each), keeping
its latest few sessions; and the check that everything they were told was kept is in the
store."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from memory_store.client import MemoryStoreClient
from memory_store.errors import NotFound, StoreError

WORDS = ["river", "stone", "lantern", "orchard", "copper", "meadow", "harbor", "violet"]


def tenant_of(key: str) -> str:
    """The tenant id the server gives an API key (server/settings.py's tenant_of, repeated:
    bench/ never imports server/), which names its sessions' namespaces in the store."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def namespace(key: str, sid: str) -> str:
    return f"sess:{tenant_of(key)}.{sid}"


@dataclass
class Acknowledged:
    """What one session was told it keeps."""

    key: str
    documents: list[tuple[str, str]] = field(default_factory=list)  # doc id, text
    turns: list[tuple[str, str]] = field(default_factory=list)  # question, answer


@dataclass
class Ledger:
    """What the clients saw, and what they were told was kept."""

    statuses: Counter[str] = field(default_factory=Counter)
    ttft: list[float] = field(default_factory=list)
    phase: str = "all"  # with --alternate: "quiet" or "hostile", the block now running
    ttft_by_phase: dict[str, list[float]] = field(default_factory=dict)  # by the chat's start
    unchecked: dict[str, Acknowledged] = field(default_factory=dict)  # session id ->
    checked: Counter[str] = field(default_factory=Counter)  # documents/turns acknowledged/lost
    hostile: Counter[str] = field(default_factory=Counter)
    chaos: list[str] = field(default_factory=list)

    def saw(self, what: str, response: httpx.Response | None) -> None:
        status = "transport" if response is None else str(response.status_code)
        self.statuses[f"{what} {status}"] += 1


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


async def streamed_chat(
    ledger: Ledger, http: httpx.AsyncClient, payload: dict, deadline: float, retries: int = 60
) -> str | None:
    """Stream until one answer arrives whole (counting every try), recording the TTFT from
    the first try; None when the run ends first."""
    started = time.monotonic()
    phase = ledger.phase
    for _ in range(retries):
        parts: list[str] = []
        first = None
        outcome = "transport"
        try:
            async with http.stream("POST", "/chat/completions", json=payload) as response:
                outcome = str(response.status_code)
                if response.status_code == 200:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line.removeprefix("data: "))
                        if "error" in event:
                            outcome = "stream-error"
                            break
                        for choice in event.get("choices", []):
                            if text := (choice.get("delta") or {}).get("content"):
                                first = first or time.monotonic()
                                parts.append(text)
                else:
                    await response.aread()
        except httpx.HTTPError:
            outcome = "transport"
        ledger.statuses[f"chat {outcome}"] += 1
        if outcome == "200":
            ttft = (first or time.monotonic()) - started
            ledger.ttft.append(ttft)
            ledger.ttft_by_phase.setdefault(phase, []).append(ttft)
            return "".join(parts)
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.5)
    return None


async def check(store: MemoryStoreClient, sid: str, kept: Acknowledged) -> Counter[str]:
    """A session's acknowledged documents and turns, looked up in the store's records (raises
    StoreError while the store cannot answer)."""
    space = namespace(kept.key, sid)
    records = await store.list_records(space)
    found: Counter[str] = Counter()
    for doc_id, text in kept.documents:
        doc = records.get(f"doc.{doc_id}")
        # ready, or queued with its text (a status save lost to an outage: a restore reads it)
        ok = doc is not None and doc.get("status") != "failed"
        if ok:
            try:
                blob = await store.get_blob(space, f"text.{doc_id}")
                ok = blob.decode("utf-8", "surrogatepass") == text
            except NotFound:
                ok = False
        found["documents_acknowledged"] += 1
        found["documents_lost"] += not ok
    stored = {
        ((turn.get("messages") or [["", ""]])[-1][1], turn.get("answer"))
        for key, turn in records.items()
        if key.startswith("turn.")
    }
    for question, answer in kept.turns:
        found["turns_acknowledged"] += 1
        found["turns_lost"] += (question, answer) not in stored
    return found


async def check_when_up(
    store: MemoryStoreClient, sid: str, kept: Acknowledged, attempts: int = 30
) -> Counter[str]:
    """check(), retried while the store (just restarted) cannot answer yet."""
    for _ in range(attempts - 1):
        try:
            return await check(store, sid, kept)
        except StoreError:
            await asyncio.sleep(2)
    return await check(store, sid, kept)


async def retire(
    ledger: Ledger, store: MemoryStoreClient, http: httpx.AsyncClient, sid: str, end: float
) -> bool:
    """Check a session, then delete it; False (kept for later) while the store is down."""
    try:
        ledger.checked += await check(store, sid, ledger.unchecked[sid])
    except StoreError:
        return False
    del ledger.unchecked[sid]
    await step(ledger, "delete", http, "DELETE", f"/sessions/{sid}", end)
    return True


async def client(
    index: int,
    base: str,
    model: str,
    args: argparse.Namespace,
    ledger: Ledger,
    store: MemoryStoreClient,
    end: float,
) -> None:
    key = f"soak-honest-{index}"
    headers = {"authorization": f"Bearer {key}"}
    live: list[str] = []  # this client's sessions, oldest first
    async with httpx.AsyncClient(base_url=f"{base}/v1", timeout=300, headers=headers) as http:
        n = 0
        while time.monotonic() < end:
            n += 1
            if len(live) >= args.keep_sessions and await retire(ledger, store, http, live[0], end):
                live.pop(0)
            created = await step(ledger, "create", http, "POST", "/sessions", end, {})
            if created is None:
                return
            sid = created.json()["id"]
            kept = ledger.unchecked[sid] = Acknowledged(key)
            live.append(sid)
            rng = random.Random(f"{args.seed}-{index}-{n}")
            code = rng.randrange(1000, 9999)
            text = " ".join(rng.choice(WORDS) for _ in range(120)) + f" The code is {code}."
            body = {"name": f"doc-{index}-{n}.txt", "text": text}
            uploaded = await step(
                ledger, "upload", http, "POST", f"/sessions/{sid}/documents", end, body
            )
            if uploaded is None:
                return
            doc_id = uploaded.json()["id"]
            status = "gone"  # unless a poll says otherwise before the grace period ends
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
            kept.documents.append((doc_id, text))
            messages: list[dict] = []
            for question in ["What is the code?", "Say it again.", "Is it odd?"][: args.turns]:
                messages.append({"role": "user", "content": question})
                payload = {
                    "model": model,
                    "messages": messages,
                    "session_id": sid,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "stream": True,
                }
                answer = await streamed_chat(ledger, http, payload, end)
                if answer is None:
                    break
                kept.turns.append((question, answer))
                messages.append({"role": "assistant", "content": answer})
