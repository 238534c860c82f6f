"""End-to-end fixtures: real `longserve serve` processes on free ports, talked to over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import HOST, free_port, save_tiny_llama, wait_for_process

API_KEY = "e2e-key"


@dataclass
class ServerProcess:
    base_url: str
    process: subprocess.Popen
    log_path: Path

    @property
    def api_base(self) -> str:
        return f"{self.base_url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
            return response.read().decode()


def launch_server(tmp_path: Path, *extra: str) -> ServerProcess:
    """Start `longserve serve` with `extra` arguments on a free port; returns at once (see
    `wait_ready`)."""
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "server.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        API_KEY,
        "--data-dir",
        str(tmp_path / f"data-{port}"),
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log = log_path.open("wb")
    process = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).resolve().parents[2]
    )
    return ServerProcess(f"http://{HOST}:{port}", process, log_path)


def wait_ready(server: ServerProcess, timeout: float = 240.0) -> ServerProcess:
    """Wait until a launched server answers /ready; stopped, and the test failed, if it does not
    within `timeout` seconds."""
    try:
        wait_for_process(
            server.process, f"{server.base_url}/ready", server.log, timeout, interval_s=0.5
        )
    except AssertionError:
        stop_server(server)
        raise
    return server


def start_server(tmp_path: Path, *extra: str, timeout: float = 240.0) -> ServerProcess:
    return wait_ready(launch_server(tmp_path, *extra), timeout)


def start_servers(
    tmp_path: Path, count: int, *extra: str, timeout: float = 240.0
) -> list[ServerProcess]:
    """`count` servers of the same arguments, started side by side: a model load runs on one
    thread, so two loads overlap on a 2-core machine (docs/decisions/087). All are stopped if
    any fails to start."""
    servers = [launch_server(tmp_path, *extra) for _ in range(count)]
    try:
        for server in servers:
            wait_ready(server, timeout)
    except BaseException:
        for server in servers:
            stop_server(server)
        raise
    return servers


def stop_server(server: ServerProcess) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    """The embedded SmolLM2-135M-Instruct behind a real server process, shared by the module."""
    proc = start_server(tmp_path_factory.mktemp("e2e"))
    yield proc
    stop_server(proc)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, hidden 64) with the embedded model's tokenizer, saved for
    `--model`: for servers whose tests check no answer of the real model (it loads in a second
    where the embedded GGUF takes tens of seconds on a shared CPU)."""
    from transformers import AutoTokenizer

    from engine.runner.loader import embedded_model_path

    gguf = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # not "tiny-llama": tests/engine's model of that name is served as "tiny-llama0"
    return save_tiny_llama(tmp_path_factory.mktemp("e2e-tiny"), tokenizer, positions=4096)


@pytest.fixture(scope="session")
def client(server):
    """The official SDK's client for the shared server."""
    import openai

    return openai.OpenAI(base_url=server.api_base, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def model_id(client) -> str:
    return client.models.list().data[0].id


def upload_and_wait(
    api_base: str, name: str, text: str, timeout_s: float, poll_s: float = 0.5
) -> tuple[dict, dict]:
    """Create a session, upload `text` as a document and wait until it is read: returns the
    session and the document objects (the document `ready`, or the test fails)."""
    import httpx

    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=api_base, headers=headers, timeout=60) as http:
        session = http.post("/sessions", json={}).json()
        doc = http.post(
            f"/sessions/{session['id']}/documents", json={"name": name, "text": text}
        ).json()
        deadline = time.monotonic() + timeout_s
        while doc["status"] not in ("ready", "failed"):
            assert time.monotonic() < deadline, f"not read after {timeout_s} s: {doc}"
            time.sleep(poll_s)
            doc = http.get(f"/sessions/{session['id']}/documents/{doc['id']}").json()
    assert doc["status"] == "ready", doc
    return session, doc
