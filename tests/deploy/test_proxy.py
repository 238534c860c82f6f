"""deploy/nginx.conf: `nginx -t` accepts it; the real nginx keeps a session on one replica, spreads
the rest and moves a dead replica's sessions; it streams unbuffered and re-resolves replicas; it
limits each API key's (else address's) request rate and connections, with an OpenAI-shaped 429."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.deploy.tools import DEPLOY, nginx_check, require
from tests.helpers import HOST, free_port, wait_for_process

CONFIG = DEPLOY / "nginx.conf"
SHIPPED_SERVER = "server server:8000 resolve;"
# Open-source nginx accepts `resolve` on an upstream's servers since this release.
RESOLVE_SINCE = (1, 27, 3)


def local_nginx() -> str:
    return require("nginx", Path("/usr/sbin/nginx"), install="apt-get install nginx-light")


def nginx_version(nginx: str) -> tuple[int, ...]:
    result = subprocess.run([nginx, "-v"], capture_output=True, text=True, timeout=30, check=True)
    match = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", result.stderr + result.stdout)
    assert match, f"no version in `nginx -v`: {result.stderr!r}"
    return tuple(int(part) for part in match.groups())


def replaced(text: str, old: str, new: str, count: int = 1) -> str:
    """`text` with `old` replaced by `new`; fails unless `old` occurs exactly `count` times."""
    found = text.count(old)
    assert found == count, f"expected {old!r} {count} time(s) in {CONFIG}, found it {found}"
    return text.replace(old, new)


def upstream_block(text: str) -> tuple[str, str]:
    match = re.search(r"^\s*upstream (\w+) \{(.*?)\}", text, re.M | re.S)
    assert match, f"no upstream block in {CONFIG}"
    return match.group(1), match.group(2)


def test_proxy_config_passes_nginx_check(tmp_path: Path) -> None:
    nginx = local_nginx()
    text = CONFIG.read_text()
    assert SHIPPED_SERVER in text
    if nginx_version(nginx) < RESOLVE_SINCE:
        # An older nginx rejects `resolve` there, and without it resolves `server` while checking,
        # a name only Docker's DNS knows: check a copy naming an address, all else unchanged.
        text = replaced(text, SHIPPED_SERVER, "server 127.0.0.1:8000;")
    result = nginx_check(nginx, text, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_proxy_streams_and_follows_scaling() -> None:
    text = CONFIG.read_text()
    assert re.search(r"resolver 127\.0\.0\.11 valid=\d+s", text), "Docker's DNS, short TTL"
    name, upstream = upstream_block(text)
    assert SHIPPED_SERVER in upstream, "`resolve`: replicas added by --scale are seen"
    assert re.search(r"^\s*zone \w+ \d+k;", upstream, re.M), "`resolve` needs a shared zone"
    assert f"proxy_pass http://{name};" in text
    assert "proxy_buffering off;" in text, "server-sent events must not be buffered"
    assert "proxy_next_upstream error timeout;" in text, "a dead replica's sessions move"


def test_proxy_hash_keeps_its_key_across_resolved_replicas() -> None:
    # `hash ... consistent` builds its ring from server names, and every replica resolved from
    # `server` carries that one name, so it would balance round robin and ignore the key.
    _, upstream = upstream_block(CONFIG.read_text())
    assert re.search(r"^\s*hash \$longserve_affinity_key;", upstream, re.M), upstream


class NamedReplica(BaseHTTPRequestHandler):
    """Answers every request with the name of the replica it stands for."""

    replica = ""

    def answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = self.replica.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = answer

    def log_message(self, format: str, *args: object) -> None:
        pass


class Replica:
    """A stand-in `server` replica on a local port, served from a thread until `stop()`."""

    def __init__(self, name: str) -> None:
        self.name = name
        handler = type(f"Replica_{name}", (NamedReplica,), {"replica": name})
        self.http = ThreadingHTTPServer((HOST, 0), handler)
        self.thread = threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"{HOST}:{self.http.server_address[1]}"

    def stop(self) -> None:
        if self.thread.is_alive():
            self.http.shutdown()
            self.thread.join(timeout=5)
        self.http.server_close()


@dataclass
class Proxy:
    url: str
    replicas: dict[str, Replica]

    keys = itertools.count()

    def reached(
        self, path: str = "/v1/models", session: str | None = None, key: str | None = None
    ) -> str:
        """The name of the replica that answered a GET of `path` (a POST where it carries a
        body), sending `session` in the affinity header when given. Each call sends an API key
        of its own unless `key` names one, so the per-key rate limit stays out of the way."""
        headers = {"Authorization": f"Bearer {key or f'k{next(self.keys)}'}"}
        if session:
            headers["X-Longserve-Session"] = session
        data = b'{"input": "x"}' if "/documents" in path or "/chat" in path else None
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=5) as response:
            return str(response.read().decode())


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[Proxy]:
    """deploy/nginx.conf run by the local nginx on a free port, over replicas "a" and "b": the
    same config but for the upstream's addresses, the port and scratch paths."""
    nginx = local_nginx()
    replicas = {name: Replica(name) for name in ("a", "b")}
    port = free_port()
    text = CONFIG.read_text()
    text = replaced(
        text,
        SHIPPED_SERVER,
        f"server {replicas['a'].address};\n        server {replicas['b'].address};",
    )
    text = replaced(text, "listen 8000;", f"listen {HOST}:{port};")
    text = replaced(text, "access_log /dev/stdout;", "access_log off;")
    text = replaced(text, "/tmp/", f"{tmp_path}/", count=6)  # pid file and temp paths
    config = tmp_path / "nginx.conf"
    config.write_text(text)
    (tmp_path / "logs").mkdir()
    log_path = tmp_path / "nginx.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [nginx, "-p", f"{tmp_path}/", "-e", "stderr", "-c", str(config), "-g", "daemon off;"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://{HOST}:{port}"
        wait_for_process(process, f"{url}/proxy-health", log_path.read_text, timeout_s=10)
        yield Proxy(url, replicas)
    finally:
        process.terminate()
        process.wait(timeout=10)
        for replica in replicas.values():
            replica.stop()


def test_proxy_keeps_a_session_on_one_replica(proxy: Proxy) -> None:
    by_header = Counter(proxy.reached("/v1/chat/completions", "sess_A") for _ in range(30))
    assert len(by_header) == 1, by_header
    (holder,) = by_header
    assert proxy.reached("/v1/sessions/sess_A/documents") == holder
    assert proxy.reached("/v1/sessions/sess_A") == holder


def test_proxy_spreads_requests_naming_no_session(proxy: Proxy) -> None:
    unnamed = Counter(proxy.reached() for _ in range(40))
    assert set(unnamed) == {"a", "b"}, unnamed
    sessions = {proxy.reached(session=f"sess_{n:032x}") for n in range(16)}
    assert sessions == {"a", "b"}, "sessions are spread over the replicas too"


def test_proxy_moves_a_dead_replicas_sessions(proxy: Proxy) -> None:
    holder = proxy.reached("/v1/chat/completions", "sess_A")
    proxy.replicas[holder].stop()
    (other,) = set(proxy.replicas) - {holder}
    moved = [proxy.reached("/v1/chat/completions", "sess_A") for _ in range(5)]
    assert moved == [other] * 5
    assert proxy.reached("/v1/sessions/sess_A/documents") == other


def test_proxy_limits_each_key_and_address() -> None:
    text = CONFIG.read_text()
    key_map = re.search(r"map \$http_authorization \$(\w+) \{(.*?)\}", text, re.S)
    assert key_map and '"" $binary_remote_addr;' in key_map.group(2), "no key: the address"
    key = key_map.group(1)
    assert re.search(rf"limit_req_zone \${key} zone=(\w+):\d+m rate=\d+r/s;", text)
    assert re.search(r"limit_req_zone \$binary_remote_addr zone=\w+:\d+m rate=\d+r/s;", text)
    assert re.search(rf"limit_conn_zone \${key} zone=\w+:\d+m;", text)
    location = text[text.index("location / {") :]
    assert len(re.findall(r"^\s*limit_req zone=\w+ burst=\d+ nodelay;", location, re.M)) == 2
    assert re.search(r"^\s*limit_conn \w+ \d+;", location, re.M)
    assert "limit_req_status 429;" in text and "limit_conn_status 429;" in text


def test_proxy_refuses_a_flooding_key_and_serves_the_others(proxy: Proxy) -> None:
    statuses: Counter[int] = Counter()
    refusal = None
    for _ in range(80):  # twice the burst, far faster than 20 a second
        try:
            proxy.reached(key="flooding")
            statuses[200] += 1
        except urllib.error.HTTPError as e:
            statuses[e.code] += 1
            refusal = e
    assert statuses[429] >= 20 and set(statuses) == {200, 429}, statuses
    assert refusal is not None and refusal.headers["Retry-After"] == "1"
    body = json.loads(refusal.read())
    assert body["error"]["type"] == "rate_limit_error", body
    assert body["error"]["code"] == "rate_limited"
    assert proxy.reached(key="honest") in {"a", "b"}  # another key is still served
