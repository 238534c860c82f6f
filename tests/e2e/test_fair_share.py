"""Fair share between tenants (issue 41 item 5), through HTTP on a real server with two keys:
one key flooding the queue gets the 429s, the other is still admitted and answered promptly.

Before engine/scheduler/fair.py the global queue was the only limit: the flood filled it and
the other key's requests were refused with 429 too."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from .conftest import start_server, stop_server

pytestmark = pytest.mark.real_model

FLOODER, HONEST = "flooding-key", "honest-key"
FLOOD = 16  # concurrent requests of the flooding key, twice the queue
ANSWER_TOKENS = 48


@pytest.fixture(scope="module")
def two_key_server(tmp_path_factory):
    """A small queue (8 waiting, 4 running): by default one key may hold 2 waiting, 3 running."""
    proc = start_server(
        tmp_path_factory.mktemp("fair"),
        "--api-key",
        FLOODER,
        "--api-key",
        HONEST,
        "--max-waiting-requests",
        "8",
        "--max-running-requests",
        "4",
        timeout=480.0,
    )
    yield proc
    stop_server(proc)


def _client(base: str, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=f"{base}/v1", headers={"Authorization": f"Bearer {key}"}, timeout=300
    )


async def _stream(http: httpx.AsyncClient, max_tokens: int) -> tuple[int, float, float]:
    """(status, seconds to the first token, seconds to the end) of one streamed completion."""
    body = {
        "model": (await http.get("/models")).json()["data"][0]["id"],
        "prompt": "Write a long story about a lighthouse keeper.",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    first = None
    async with http.stream("POST", "/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, 0.0, time.perf_counter() - started
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - started
    assert first is not None
    return 200, first, time.perf_counter() - started


Outcome = tuple[int, float, float]


async def _beside(
    flooder: httpx.AsyncClient, honest: httpx.AsyncClient, requests: int
) -> tuple[list[Outcome], list[Outcome]]:
    """The honest key's 3 requests, one after another, while the other key has `requests`
    streams going; (the honest key's outcomes, the other key's)."""
    others = [asyncio.create_task(_stream(flooder, ANSWER_TOKENS)) for _ in range(requests)]
    await asyncio.sleep(1.0)  # they are queued and running
    honest_outcomes = [await _stream(honest, 8) for _ in range(3)]
    return honest_outcomes, list(await asyncio.gather(*others))


async def _scenario(base: str) -> tuple[list[float], list[Outcome], list[Outcome], list[Outcome]]:
    """The honest key's TTFTs alone; its outcomes beside the other key's running share (3
    streams); then beside a flood, with the flood's outcomes."""
    async with _client(base, FLOODER) as flooder, _client(base, HONEST) as honest:
        alone = [(await _stream(honest, 8))[1] for _ in range(3)]
        beside, _ = await _beside(flooder, honest, 3)
        during, flooded = await _beside(flooder, honest, FLOOD)
    return alone, beside, during, flooded


@pytest.mark.timeout(1200)  # a model load on a shared CPU
def test_a_flooding_key_gets_the_429s_and_the_other_key_is_served(two_key_server):
    alone, beside, during, flooded = asyncio.run(_scenario(two_key_server.base_url))
    flood_statuses = [status for status, _, _ in flooded]
    print(
        f"honest TTFT alone {[round(t, 3) for t in alone]} s, "
        f"beside 3 streams of the other key {[round(t, 3) for _, t, _ in beside]} s, "
        f"under its flood {[round(t, 3) for _, t, _ in during]} s; "
        f"flood: {flood_statuses.count(200)} answered, {flood_statuses.count(429)} refused"
    )
    assert [status for status, _, _ in beside + during] == [200] * 6, (beside, during)
    # the flooding key holds at most 3 running and 2 waiting; the rest of its flood is refused
    assert flood_statuses.count(429) >= FLOOD - 5 - 3, flood_statuses
    assert set(flood_statuses) <= {200, 429}, flood_statuses
    # The flood costs the honest key no more than the other key's running share does (the
    # device is shared either way): a generous bound, this machine's load varies by seconds.
    worst_beside = max(t for _, t, _ in beside)
    worst_during = max(t for _, t, _ in during)
    assert worst_during < 3 * worst_beside + 2.0, (alone, beside, during)
