"""The compose stack under test: docker-compose.yml with the test override, driven as an
operator would (`up`, `down`, `docker kill`, `docker start`), and read from outside: the API
through the proxy's published port, Prometheus on its own, each replica's /metrics at its
container address (only to see which replica did what)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.deploy.compose_config import compose_command
from tests.helpers import free_port
from tests.stack.engine import run

REPO = Path(__file__).resolve().parents[2]
OVERRIDE = Path(__file__).with_name("compose.test.yml")
API_KEY = "stack-test-key"


class Stack:
    def __init__(self, name: str, log_dir: Path, profiles: tuple[str, ...] = ()) -> None:
        self.name = name
        self.log_dir = log_dir
        self.port = free_port()
        self.prometheus_port = free_port()
        self.env = {
            **os.environ,
            "LONGSERVE_API_KEYS": API_KEY,
            "REDIS_PASSWORD": secrets.token_hex(16),
            "LONGSERVE_MEMORY_STORE_TOKEN": secrets.token_hex(32),
            "GRAFANA_ADMIN_PASSWORD": secrets.token_hex(16),
            "LONGSERVE_PORT": str(self.port),
            "PROMETHEUS_PORT": str(self.prometheus_port),
            "GRAFANA_PORT": str(free_port()),
        }
        self.base = [*compose_command(), "-p", name, "-f", str(REPO / "docker-compose.yml"),
                     "-f", str(OVERRIDE), *(a for p in profiles for a in ("--profile", p))]  # fmt: skip

    @property
    def api_base(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def prometheus(self) -> str:
        return f"http://127.0.0.1:{self.prometheus_port}"

    def compose(self, *args: str, timeout: float = 900) -> str:
        return run(*self.base, *args, cwd=REPO, env=self.env, timeout=timeout).stdout

    def up(self, *services: str, scale: dict[str, int] | None = None) -> float:
        """`up -d --no-build` (the images are built already); seconds until all are healthy."""
        start = time.monotonic()
        scales = [a for s, n in (scale or {}).items() for a in ("--scale", f"{s}={n}")]
        self.compose("up", "-d", "--no-build", *scales, *services)
        self.wait_healthy()
        return time.monotonic() - start

    def down(self, volumes: bool = False) -> None:
        self.save_logs(f"before-down-{time.strftime('%H%M%S')}")
        self.compose("down", "--remove-orphans", *(["-v"] if volumes else []))

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).split()

    def running(self) -> list[str]:
        ids = self.compose("ps", "-q").split()
        return [c for c in ids if self._inspect(c, "{{.State.Running}}") == "true"]

    def _inspect(self, container: str, template: str) -> str:
        return run("docker", "inspect", "-f", template, container).stdout.strip()

    def address(self, container: str) -> str:
        return self._inspect(container, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")

    def health(self, container: str) -> str:
        return self._inspect(container, "{{if .State.Health}}{{.State.Health.Status}}{{end}}")

    def wait_healthy(self, timeout: float = 600) -> None:
        """Every running container with a health check reports healthy."""
        deadline = time.monotonic() + timeout
        while True:
            states = {c: self.health(c) for c in self.running()}
            waiting = {c: s for c, s in states.items() if s not in ("", "healthy")}
            if states and not waiting:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not healthy after {timeout} s: {waiting}\n{self.logs()[-20000:]}"
                )
            time.sleep(2)

    def kill(self, container: str) -> None:
        run("docker", "kill", "--signal", "KILL", container)

    def start(self, container: str) -> None:
        run("docker", "start", container)

    def logs(self, tail: int = 60) -> str:
        done = subprocess.run([*self.base, "logs", "--no-color", "--tail", str(tail)],
                              cwd=REPO, env=self.env, capture_output=True, text=True)  # fmt: skip
        return done.stdout

    def save_logs(self, when: str = "end") -> None:
        """Every container's log so far (`down` removes the containers, and their logs)."""
        (self.log_dir / f"{self.name}-{when}.log").write_text(self.logs(tail=5000))

    def metric(self, container: str, name: str) -> float:
        """A replica's own figure (the sum over label sets), read at its container address."""
        url = f"http://{self.address(container)}:8000/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        values = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        # 0 when absent: a labelled counter shows no sample before its first event (a replica
        # that has answered nothing yet); callers compare growth, so a wrong name still fails
        assert values or "longserve:" in text, f"{container}'s /metrics has no longserve: metric"
        return sum(float(v) for v in values)
