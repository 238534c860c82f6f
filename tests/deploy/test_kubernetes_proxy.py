"""deploy/k8s/base/nginx.conf run by a real nginx over a stand-in kube-dns: two proxy replicas,
whose DNS answers list the server pods in different orders, send every session to the same pod;
a pod leaving moves only its own sessions, a pod joining takes only sessions of its own.

Needs nginx >= 1.27.3 (`resolve` and `service=` in an upstream): the one on PATH, or the binary
named by LONGSERVE_NGINX; skipped otherwise (Debian ships older ones)."""

from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
import threading
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.test_proxy import RESOLVE_SINCE, Proxy, Replica, nginx_version, replaced
from tests.deploy.tools import DEPLOY, tool
from tests.helpers import HOST, free_port, wait_for_process, wait_until

CONFIG = DEPLOY / "k8s" / "base" / "nginx.conf"
SESSIONS = [f"sess_{n:04d}" for n in range(60)]


def dns_name(name: str) -> bytes:
    return b"".join(bytes([len(label)]) + label.encode() for label in name.split(".")) + b"\0"


class StubKubeDns:
    """Answers as kube-dns does for a headless Service: `_<port>._tcp.<service>` with one SRV
    record per ready pod (a name of its own, CoreDNS's weight of 100 shared out), and each
    pod's name with its A record. `pods`, pod name -> port on HOST, is read at every query, in
    its order (reversed when `reverse`)."""

    def __init__(self, service: str, reverse: bool = False) -> None:
        self.service = service
        self.reverse = reverse
        self.pods: dict[str, int] = {}
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind((HOST, 0))
        self.port = self.socket.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def target(self, pod: str) -> str:
        return f"{pod}.{self.service}"

    def _serve(self) -> None:
        while True:
            try:
                query, client = self.socket.recvfrom(512)
            except OSError:  # closed
                return
            self.socket.sendto(self._answer(query), client)

    def _answer(self, query: bytes) -> bytes:
        labels, i = [], 12
        while query[i]:
            labels.append(query[i + 1 : i + 1 + query[i]].decode())
            i += 1 + query[i]
        qtype = struct.unpack(">H", query[i + 1 : i + 3])[0]
        question, name = query[12 : i + 5], ".".join(labels).lower()
        pods = list(self.pods.items())
        if self.reverse:
            pods.reverse()
        answers = []
        if qtype == 33 and name.endswith(f"._tcp.{self.service}") and pods:  # SRV
            weight = max(1, 100 // len(pods))
            for pod, port in pods:
                rdata = struct.pack(">HHH", 0, weight, port) + dns_name(self.target(pod))
                answers.append((33, rdata))
        elif qtype == 1:  # A
            answers += [(1, socket.inet_aton(HOST)) for pod, _ in pods if self.target(pod) == name]
        flags = 0x8180 if answers else 0x8183  # answer, or NXDOMAIN
        reply = query[:2] + struct.pack(">HHHHH", flags, 1, len(answers), 0, 0) + question
        for rtype, rdata in answers:
            reply += dns_name(name) + struct.pack(">HHIH", rtype, 1, 1, len(rdata)) + rdata
        return reply

    def close(self) -> None:
        self.socket.close()


def new_nginx() -> str:
    nginx = os.environ.get("LONGSERVE_NGINX") or tool("nginx", Path("/usr/sbin/nginx"))
    if nginx is None or nginx_version(nginx) < RESOLVE_SINCE:
        found = "none" if nginx is None else ".".join(map(str, nginx_version(nginx)))
        pytest.skip(
            f"needs nginx >= {'.'.join(map(str, RESOLVE_SINCE))} for `resolve` and `service=` "
            f"(found {found}); name one with LONGSERVE_NGINX"
        )
    return nginx


def start_proxy(nginx: str, workdir: Path, dns: StubKubeDns) -> tuple[str, subprocess.Popen[bytes]]:
    """The shipped config, but for the DNS server's address, the port and scratch paths."""
    workdir.mkdir()
    port = free_port()
    text = CONFIG.read_text()
    text = re.sub(r"resolver [\w.-]+ valid=\d+s", f"resolver {HOST}:{dns.port} valid=1s", text)
    text = replaced(text, "listen 8000;", f"listen {HOST}:{port};")
    text = replaced(text, "access_log /dev/stdout;", "access_log off;")
    text = replaced(text, "/tmp/", f"{workdir}/", count=6)
    # every session asked many times from one address: past the per-address rate limit
    text = replaced(text, "rate=50r/s", "rate=10000r/s")
    (workdir / "nginx.conf").write_text(text)
    (workdir / "logs").mkdir()
    log_path = workdir / "nginx.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [nginx, "-p", f"{workdir}/", "-e", "stderr", "-c", str(workdir / "nginx.conf")]
            + ["-g", "daemon off;"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://{HOST}:{port}"
    wait_for_process(process, f"{url}/proxy-health", log_path.read_text, timeout_s=10)
    return url, process


@pytest.fixture
def proxies(tmp_path: Path) -> Iterator[tuple[Proxy, Proxy, list[StubKubeDns]]]:
    nginx = new_nginx()
    server = re.search(r"server ([\w.-]+) service=(\w+) resolve", CONFIG.read_text())
    assert server
    replicas = {name: Replica(name) for name in ("pod-a", "pod-b", "pod-c", "pod-d")}
    stubs = [StubKubeDns(server.group(1)), StubKubeDns(server.group(1), reverse=True)]
    for stub in stubs:
        stub.pods = {
            name: int(replicas[name].address.split(":")[1]) for name in ("pod-a", "pod-b", "pod-c")
        }
    started = []
    try:
        for n, stub in enumerate(stubs):
            started.append(start_proxy(nginx, tmp_path / f"proxy-{n}", stub))
        first, second = (Proxy(url, replicas) for url, _ in started)
        yield first, second, stubs
    finally:
        for _, process in started:
            process.terminate()
            process.wait(timeout=10)
        for stub in stubs:
            stub.close()
        for replica in replicas.values():
            replica.stop()


def holders(proxy: Proxy) -> dict[str, str]:
    return {session: proxy.reached("/v1/chat/completions", session) for session in SESSIONS}


def resolved_all(proxy: Proxy, pods: set[str]) -> bool:
    """Whether `proxy` sends the sessions to exactly `pods` (502 until it has resolved any)."""
    try:
        return set(holders(proxy).values()) == pods
    except urllib.error.HTTPError as e:
        if e.code != 502:
            raise
        return False


def test_proxy_replicas_agree_and_pods_move_only_their_sessions(
    proxies: tuple[Proxy, Proxy, list[StubKubeDns]],
) -> None:
    first, second, stubs = proxies
    # until both have resolved all three pods
    wait_until(
        lambda: all(resolved_all(p, {"pod-a", "pod-b", "pod-c"}) for p in (first, second)),
        "the pods were not all resolved",
        timeout_s=15,
        interval_s=0.5,
    )
    before = holders(first)
    assert holders(second) == before, "two proxy replicas disagree on a session's pod"

    for stub in stubs:  # pod-c leaves the Service's endpoints
        del stub.pods["pod-c"]
    wait_until(
        lambda: "pod-c" not in set(holders(first).values()) | set(holders(second).values()),
        "pod-c still chosen",
        timeout_s=15,
        interval_s=0.5,
    )
    after = holders(first)
    assert holders(second) == after
    for session, pod in before.items():
        if pod != "pod-c":
            assert after[session] == pod, f"{session} moved from {pod}, which stayed"

    joined = int(first.replicas["pod-d"].address.split(":")[1])
    for stub in stubs:  # pod-d joins
        stub.pods["pod-d"] = joined
    wait_until(
        lambda: (
            "pod-d" in set(holders(first).values()) and "pod-d" in set(holders(second).values())
        ),
        "pod-d never chosen",
        timeout_s=15,
        interval_s=0.5,
    )
    scaled = holders(first)
    assert holders(second) == scaled
    for session, pod in scaled.items():
        assert pod in {after[session], "pod-d"}, f"{session} moved between pods that stayed"
