"""The memory service's shared secret (issue #41 item 7), on a real `longserve memory-store`
process: no token or a wrong one is a 401 on every route but the probes, the right one works,
and a bind beyond loopback without a token refuses to start."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from memory_store.client import http_client
from memory_store.encodings import DocumentManifest
from memory_store.errors import StoreUnavailableError
from tests.helpers import free_port, wait_for_process

TOKEN = "s3cret-memory-store-token"
REPO = Path(__file__).resolve().parents[2]


def memory_store_command(port: int, data_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "server.cli", "memory-store", "--port", str(port),
            "--data-dir", str(data_dir), *extra]  # fmt: skip


def env_with(token: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LONGSERVE_MEMORY_STORE_")}
    if token is not None:
        env["LONGSERVE_MEMORY_STORE_TOKEN"] = token
    return env


@pytest.fixture
def service(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = tmp_path / "memory-store.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            memory_store_command(port, tmp_path / "store"),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env_with(TOKEN),
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_process(proc, f"{url}/health", lambda: log.read_text(errors="replace"), 60)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_every_route_but_the_probes_wants_the_token(service: str) -> None:
    path = "/v1/sessions/t.s/documents"
    with httpx.Client(base_url=service, timeout=10) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
            for method, url in (("GET", path), ("GET", "/ready"), ("DELETE", "/v1/sessions/t.s")):
                r = c.request(method, url, headers=headers)
                assert r.status_code == 401, (method, url, headers)
                error = r.json()["error"]
                assert error["code"] == "invalid_token" and TOKEN not in r.text
        r = c.get(path, headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and r.json()["data"] == []
        assert c.get("/ready", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200


async def test_the_http_client_sends_its_token(service: str) -> None:
    good = http_client(service, token=TOKEN)
    bad = http_client(service, token="wrong")
    try:
        await good.put_manifest("t.s", "d", DocumentManifest("d", "fp", ("h1",)))
        assert (await good.get_manifest("t.s", "d")).chunk_hashes == ("h1",)
        with pytest.raises(StoreUnavailableError, match="refused this server's token"):
            await bad.get_manifest("t.s", "d")
    finally:
        await good.close()
        await bad.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.1"])
def test_a_bind_beyond_loopback_without_a_token_refuses_to_start(tmp_path: Path, host: str) -> None:
    done = subprocess.run(
        memory_store_command(free_port(), tmp_path / "store", "--host", host),
        cwd=REPO,
        env=env_with(None),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "LONGSERVE_MEMORY_STORE_TOKEN" in done.stderr
    assert "Traceback" not in done.stderr
