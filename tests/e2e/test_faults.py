"""The real `longserve serve` process (embedded model) under SIGTERM: the stream in flight
finishes, new requests get 503 and /ready fails meanwhile, then the process exits with 0."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from tests.e2e.conftest import API_KEY, start_server, stop_server
from tests.helpers import wait_until

pytestmark = pytest.mark.real_model

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_sigterm_drains_then_exits_0(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LONGSERVE_DRAIN_TIMEOUT_SECONDS", "120")  # slow shared CPUs
    server = start_server(tmp_path)
    try:
        model = httpx.get(f"{server.api_base}/models", headers=AUTH).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Count to one hundred."}],
                "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
        events: list[str] = []

        def read() -> None:
            url = f"{server.api_base}/chat/completions"
            with httpx.stream("POST", url, json=body, headers=AUTH, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])

        reader = threading.Thread(target=read, daemon=True)
        reader.start()

        def streaming() -> bool:
            assert reader.is_alive() or len(events) >= 2, server.log()
            return len(events) >= 2

        wait_until(streaming, server.log, timeout_s=60)
        server.process.send_signal(signal.SIGTERM)

        wait_until(
            lambda: httpx.get(f"{server.base_url}/ready", timeout=5).status_code == 503,
            "SIGTERM did not start the drain",
            timeout_s=10,
            interval_s=0.02,
        )
        refused = httpx.post(
            f"{server.api_base}/chat/completions", json={**body, "stream": False}, headers=AUTH
        )
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "server_shutting_down"

        reader.join(timeout=150)
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c], server.log()[-3000:]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len(chunks) >= 24
        assert server.process.wait(timeout=60) == 0, server.log()
        assert "drained; shutting down" in server.log()
    finally:
        stop_server(server)
