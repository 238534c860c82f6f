"""Graceful shutdown. In process: the drain gate (503s, /ready, the in-flight count). In a real
process (tests/server/fake_server.py, served like the CLI serves): SIGTERM lets the stream in
flight finish while new requests get 503, then the process exits with status 0; a stream
longer than the drain timeout ends with an error event and [DONE], and the process still exits
cleanly; a second signal stops at once."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from server.app import build_app
from server.settings import ServerSettings
from tests.helpers import HOST, free_port, wait_for_process, wait_until, wait_until_async
from tests.server.conftest import API_KEY, MODEL
from tests.server.fake_engine import FakeEngine

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "a b c"}], "temperature": 0}
REPO = Path(__file__).resolve().parents[2]


def assert_shutting_down(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert response.headers["connection"] == "close"
    error = response.json()["error"]
    assert error["type"] == "service_unavailable_error"
    assert error["code"] == "server_shutting_down"


# --- in process ---------------------------------------------------------------------------------


async def test_draining_refuses_new_requests_but_not_health_or_metrics() -> None:
    app = build_app(ServerSettings(api_keys=[API_KEY]), FakeEngine(MODEL))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH) as http:
        assert (await http.get("/ready")).status_code == 200
        app.state.drain.start()
        ready = await http.get("/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        assert_shutting_down(await http.post("/v1/chat/completions", json=CHAT))
        assert_shutting_down(await http.get("/v1/models"))
        assert_shutting_down(await http.post("/v1/sessions", json={}))
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200
    assert app.state.drain.in_flight == 0


async def test_in_flight_counts_a_stream_until_it_ends() -> None:
    engine = FakeEngine(MODEL)
    engine.gate.clear()
    app = build_app(ServerSettings(api_keys=[API_KEY]), engine)
    drain = app.state.drain
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH) as http:
        body = {**CHAT, "stream": True}
        call = asyncio.create_task(http.post("/v1/chat/completions", json=body))
        await wait_until_async(lambda: engine.running, "the stream never reached the engine")
        assert drain.in_flight == 1
        await http.get("/health")  # ungated: not counted
        assert drain.in_flight == 1
        drain.start()
        engine.gate.set()
        response = await call
        assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
    assert drain.in_flight == 0


# --- a real process -----------------------------------------------------------------------------


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def serve_fake(tmp_path: Path) -> Iterator[object]:
    started: list[Served] = []

    def start(drain_timeout: float, token_delay: float = 0.05) -> Served:
        port = free_port()
        log_path = tmp_path / f"server-{port}.log"
        cmd = [sys.executable, "-m", "tests.server.fake_server", "--port", str(port),
               "--api-key", API_KEY, "--model", MODEL,
               "--drain-timeout", str(drain_timeout), "--token-delay", str(token_delay)]  # fmt: skip
        with log_path.open("wb") as log:
            process = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        served = Served(process, f"http://{HOST}:{port}", log_path)
        started.append(served)
        wait_for_process(process, f"{served.base_url}/ready", served.log, timeout_s=30)
        return served

    yield start
    for served in started:
        if served.process.poll() is None:
            served.process.kill()
            served.process.wait()


class StreamReader(threading.Thread):
    """Reads one streamed chat completion in the background, keeping every SSE data line."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = f"{base_url}/v1/chat/completions"
        self.body = {**CHAT, "stream": True, "max_tokens": max_tokens, "ignore_eos": True}
        self.events: list[str] = []
        self.status: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=AUTH, timeout=60) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
        except httpx.HTTPError as exc:  # a cut stream
            self.error = exc

    def wait_for_events(self, count: int) -> None:
        def arrived() -> bool:
            assert self.is_alive() or len(self.events) >= count, (self.events, self.error)
            return len(self.events) >= count

        wait_until(arrived, lambda: (self.events, self.error), timeout_s=10)

    def text(self) -> str:
        chunks = [json.loads(e) for e in self.events if e != "[DONE]"]
        return "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
        )


def wait_until_draining(base_url: str) -> None:
    wait_until(
        lambda: httpx.get(f"{base_url}/ready", timeout=2).status_code == 503,
        "SIGTERM did not start the drain",
        timeout_s=5,
        interval_s=0.02,
    )


def test_sigterm_drains_the_stream_in_flight_then_exits_0(serve_fake) -> None:
    served = serve_fake(drain_timeout=20)
    stream = StreamReader(served.base_url, max_tokens=40)  # about 2 s of tokens
    stream.start()
    stream.wait_for_events(3)
    served.process.send_signal(signal.SIGTERM)

    wait_until_draining(served.base_url)
    assert_shutting_down(
        httpx.post(f"{served.base_url}/v1/chat/completions", json=CHAT, headers=AUTH, timeout=5)
    )
    assert httpx.get(f"{served.base_url}/health", timeout=5).status_code == 200
    assert stream.is_alive(), "the stream in flight must not be cut by the drain"

    stream.join(timeout=20)
    assert stream.error is None and stream.status == 200
    assert stream.events[-1] == "[DONE]"
    assert stream.text() == " ".join(["a", "b", "c"] * 14)[: len(stream.text())]
    assert len(stream.text().split()) == 40
    assert served.process.wait(timeout=15) == 0, served.log()
    log = served.log()
    assert "drained; shutting down" in log
    assert "engine shut down: True" in log


def test_a_stream_longer_than_the_drain_timeout_is_cut_and_the_exit_is_clean(serve_fake) -> None:
    served = serve_fake(drain_timeout=1)
    stream = StreamReader(served.base_url, max_tokens=2000)  # about 100 s of tokens
    stream.start()
    stream.wait_for_events(3)
    signalled = time.monotonic()
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=15) == 0, served.log()
    elapsed = time.monotonic() - signalled
    assert 1.0 <= elapsed < 8, elapsed
    stream.join(timeout=10)
    assert not stream.is_alive()
    # Cut like any failed stream: one error event, then [DONE].
    assert stream.error is None and stream.events[-1] == "[DONE]"
    error = json.loads(stream.events[-2])["error"]
    assert error["code"] == "server_shutting_down"
    assert len(stream.text().split()) < 2000
    log = served.log()
    assert "drain timeout (1s) passed with 1 request(s) in flight" in log
    assert "without completing response" not in log
    assert "engine shut down: True" in log


def test_a_second_signal_stops_at_once(serve_fake) -> None:
    served = serve_fake(drain_timeout=60)
    stream = StreamReader(served.base_url, max_tokens=2000)
    stream.start()
    stream.wait_for_events(3)
    served.process.send_signal(signal.SIGTERM)
    wait_until_draining(served.base_url)
    signalled = time.monotonic()
    served.process.send_signal(signal.SIGTERM)
    # uvicorn's own handling: stop now, then die of the signal as an unhandled one would.
    assert served.process.wait(timeout=15) == -signal.SIGTERM
    assert time.monotonic() - signalled < 8
    stream.join(timeout=10)
    assert not stream.is_alive()
