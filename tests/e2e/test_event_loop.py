"""The event loop only does I/O: `/health` answers while a huge prompt is being tokenized
(docs/decisions/057). The run's shared server process (conftest.py's `server`): the embedded
model and its real tokenizer."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import API_KEY, ServerProcess

PROMPT_BYTES = 30_000_000  # issue #41: /health froze for 33 s while 24 MB were tokenized
PROBES = 600  # at most: probes run until the answer
PROBE_INTERVAL_S = 0.1  # its preparation takes 7 to 40 s on this loaded 2-core machine
LINE = "The harvest came late that year, and the river ran high past the old mill.\n"


def _huge_completion(base_url: str, sent: threading.Event, outcome: dict) -> None:
    """POST a PROMPT_BYTES completions prompt; `sent` once the body is out, then its status
    and when it came in `outcome`."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    model = httpx.get(f"{base_url}/v1/models", headers=headers).json()["data"][0]["id"]
    prompt = LINE * (PROMPT_BYTES // len(LINE))
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1}).encode()

    def upload() -> Iterator[bytes]:
        for start in range(0, len(body), 1 << 20):
            yield body[start : start + (1 << 20)]
        outcome["sent_at"] = time.perf_counter()
        sent.set()

    try:
        response = httpx.post(
            f"{base_url}/v1/completions", content=upload(), headers=headers, timeout=600
        )
        outcome["status"] = response.status_code
        outcome["error"] = response.json()["error"]
    finally:
        outcome["done_at"] = time.perf_counter()


@pytest.mark.timeout(900)  # a server start on a loaded 2-core machine, then ~40 s of tokenizing
def test_health_answers_while_a_huge_prompt_is_tokenized(server: ServerProcess) -> None:
    sent, outcome = threading.Event(), {}
    thread = threading.Thread(
        target=_huge_completion, args=(server.base_url, sent, outcome), daemon=True
    )
    thread.start()
    assert sent.wait(120), "the prompt was not uploaded"
    latencies, slowest_at = [], 0.0
    with httpx.Client(base_url=server.base_url, timeout=600) as http:
        while len(latencies) < PROBES and "done_at" not in outcome:
            started = time.perf_counter()
            assert http.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            if latencies[-1] == max(latencies):
                slowest_at = started - outcome["sent_at"]
            time.sleep(PROBE_INTERVAL_S)
    thread.join(600)
    seconds = outcome["done_at"] - outcome["sent_at"]
    latencies.sort()
    p50, p99 = statistics.median(latencies), latencies[int(0.99 * (len(latencies) - 1))]
    print(
        f"\n/health over {len(latencies)} probes while a {PROMPT_BYTES / 1e6:.0f} MB prompt was "
        f"prepared ({seconds:.1f} s, then {outcome['status']}): p50 {p50 * 1000:.1f} ms, "
        f"p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms ({slowest_at:.1f} s in)"
    )
    assert latencies[-1] < 1.0, f"/health took {latencies[-1]:.2f} s"
    assert len(latencies) >= 10, "the prompt was prepared before 10 probes: nothing measured"
    # past max_prompt_tokens: refused once counted, cleanly, naming the limit
    assert outcome["status"] == 400 and outcome["error"]["code"] == "context_length_exceeded"
