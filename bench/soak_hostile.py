"""The soak's hostile tenants (bench/soak.py --hostile N): each its own API key, looping over
attacks until the run ends, every answer counted as "ATTACK STATUS".

    metadata  a stored response with 2 MB of metadata (2,000 pairs of 1 KB)
    stored    stored responses with 1 MB of tools (not rendered: tool_choice "none") and with
              an 8 KB input (about 1K tokens read: the bytes stored, not the reading, are the
              point)
    prompt    a 24 MB completions prompt (about 3M tokens; the body limit is 32 MiB)
    flood     FLOOD_SIZE short chats at once, to fill the queue
    pdf       a session, then crafted PDFs (bench/crafted_pdf.py: 2,500 pages, one page of
              1.5M text operators, a bomb expanding to 200 MB), then its deletion
    churn     CHURN_ROUNDS of create a session, upload 64 KB of text, delete the session
    ids       malformed and foreign ids in paths and bodies

A hostile request should get a 4xx (or 429 while flooding), or a 200 where the input is within
the limits; a 5xx or a broken connection is a defect of the server (`defects()`), except that
while the chaos kills the store anyone may get a 503 (compare with a --no-chaos run). A
request broken after its client's cut-off (the end of an --alternate block) is counted as
`cut-off`, not as a defect.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from bench.crafted_pdf import bomb, many_pages, slow_page

ATTACKS = ("metadata", "stored", "prompt", "flood", "pdf", "churn", "ids")
FLOOD_SIZE = 96
CHURN_ROUNDS = 5
WORD = "lantern "


@dataclass(frozen=True)
class Payloads:
    """The large bodies, built once per run: every hostile client sends the same bytes."""

    huge_prompt: bytes
    pdfs: dict[str, bytes]

    @classmethod
    def build(cls, model: str) -> Payloads:
        body = {"model": model, "prompt": WORD * (24 * 1024 * 1024 // len(WORD)), "max_tokens": 1}
        pdfs = {
            "pages.pdf": many_pages(2500),
            "slow.pdf": slow_page(1_500_000),
            "bomb.pdf": bomb(200_000_000),
        }
        return cls(json.dumps(body).encode(), pdfs)


class Hostile:
    """One hostile tenant: its client, the model id, the payloads, and the shared count of
    answers."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        model: str,
        payloads: Payloads,
        statuses: Counter[str],
        end: float = math.inf,
    ) -> None:
        self.http, self.model, self.payloads, self.statuses = http, model, payloads, statuses
        self.end = end  # the client is cut off then: what breaks after it is ours, not a defect

    async def send(self, attack: str, method: str, url: str, **kwargs) -> httpx.Response | None:
        try:
            response = await self.http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            late = time.monotonic() >= self.end
            self.statuses[
                f"{attack} {'cut-off' if late else 'transport'}:{type(exc).__name__}"
            ] += 1
            return None
        self.statuses[f"{attack} {response.status_code}"] += 1
        return response

    async def metadata(self) -> None:
        pairs = {f"k{i:04d}": "m" * 1024 for i in range(2000)}
        body = {"model": self.model, "input": "Hi", "max_output_tokens": 1, "metadata": pairs}
        await self.send("metadata", "POST", "/responses", json={**body, "store": True})

    async def stored(self) -> None:
        tools = [
            {"type": "function", "name": f"tool_{i}", "description": "d" * 16384,
             "parameters": {"type": "object", "properties": {}}}
            for i in range(64)
        ]  # fmt: skip
        base = {"model": self.model, "max_output_tokens": 1, "store": True}
        await self.send(
            "stored", "POST", "/responses",
            json={**base, "input": "Hi", "tools": tools, "tool_choice": "none"},
        )  # fmt: skip
        await self.send("stored", "POST", "/responses", json={**base, "input": WORD * 1024})

    async def prompt(self) -> None:
        await self.send(
            "prompt", "POST", "/completions", content=self.payloads.huge_prompt,
            headers={"content-type": "application/json"},
        )  # fmt: skip

    async def flood(self) -> None:
        body = {"model": self.model, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": "Count to ten."}]}  # fmt: skip
        await asyncio.gather(
            *(self.send("flood", "POST", "/chat/completions", json=body) for _ in range(FLOOD_SIZE))
        )

    async def pdf(self) -> None:
        created = await self.send("pdf", "POST", "/sessions", json={})
        if created is None or created.status_code != 200:
            return
        sid = created.json()["id"]
        for name, data in self.payloads.pdfs.items():
            files = {"file": (name, data, "application/pdf")}
            await self.send("pdf", "POST", f"/sessions/{sid}/documents", files=files)
        await self.send("pdf", "DELETE", f"/sessions/{sid}")

    async def churn(self) -> None:
        for _ in range(CHURN_ROUNDS):
            created = await self.send("churn", "POST", "/sessions", json={})
            if created is None or created.status_code != 200:
                return
            sid = created.json()["id"]
            body = {"name": "churn.txt", "text": WORD * 8192}
            await self.send("churn", "POST", f"/sessions/{sid}/documents", json=body)
            await self.send("churn", "DELETE", f"/sessions/{sid}")

    async def ids(self) -> None:
        long_id = "resp_" + "a" * 5000
        for method, url in [
            ("GET", "/responses/resp_%2A"),
            ("GET", "/responses/resp_..%2F..%2Fetc%2Fpasswd"),
            ("DELETE", f"/responses/{long_id}"),
            ("GET", "/sessions/sess_%00"),
            ("GET", "/sessions/..%2F..%2Fadmin/documents"),
            ("GET", "/sessions/sess_0000/documents/doc_%2A"),
            ("DELETE", "/sessions/sess_" + "f" * 5000),
        ]:
            await self.send("ids", method, url)
        chat = {"model": self.model, "max_tokens": 1,
                "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
        await self.send("ids", "POST", "/chat/completions", json={**chat, "session_id": "../x"})
        body = {"model": self.model, "input": "Hi", "previous_response_id": "resp_%2A"}
        await self.send("ids", "POST", "/responses", json=body)


async def hostile_client(
    index: int,
    base: str,
    key: str,
    model: str,
    payloads: Payloads,
    attacks: list[str],
    statuses: Counter[str],
    end: float,
) -> None:
    """Attack in turn (starting at a different attack per client) until the run ends."""
    headers = {"authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=FLOOD_SIZE + 8)
    async with httpx.AsyncClient(
        base_url=f"{base}/v1", timeout=300, headers=headers, limits=limits
    ) as http:
        tenant = Hostile(http, model, payloads, statuses, end)
        turn = index
        while time.monotonic() < end:
            attack: Callable[[], Awaitable[None]] = getattr(tenant, attacks[turn % len(attacks)])
            await attack()
            turn += 1


def defects(statuses: Counter[str]) -> dict[str, int]:
    """The answers a hostile input should never get: a 5xx, or no answer at all."""
    return {
        what: count
        for what, count in sorted(statuses.items())
        if what.split(" ", 1)[1].startswith(("5", "transport"))
    }
