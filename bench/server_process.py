"""The longserve server a benchmark talks to over HTTP: one it starts on a free loopback port
(a subprocess, stopped on exit) or one already running on loopback (`--base-url`)."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def require_loopback(base_url: str) -> None:
    host = urllib.parse.urlsplit(base_url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"--base-url must be a loopback address, got {host!r}")


def wait_ready(base: str, server: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server at {base} not ready after {timeout}s")


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


@contextlib.contextmanager
def served(
    base_url: str | None,
    *,
    serve_args: Sequence[str] = (),
    ready_timeout: float = 300.0,
    prefix: str = "longserve-bench-",
    env: dict[str, str] | None = None,
    stdout: Any = None,
) -> Iterator[str]:
    """Yield the base URL (no /v1) of a ready server: base_url if given (loopback only), else
    `longserve serve` started with serve_args in a temporary data directory."""
    if base_url:
        base = base_url.rstrip("/").removesuffix("/v1")
        require_loopback(base)
        wait_ready(base, None, ready_timeout)
        yield base
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as data_dir:
        port = free_port()
        cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--data-dir", data_dir, "--log-level", "warning"]
        server = subprocess.Popen(
            [*cmd, *serve_args], env={**os.environ, **(env or {})}, stdout=stdout
        )
        previous = _exit_on_sigterm()
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base, server, ready_timeout)
            yield base
        finally:
            stop(server)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm() -> Any:
    """A bench stopped with SIGTERM (`timeout`, `kill`) unwinds, so the server it started is
    stopped too (the default action ends the process with no `finally`). The handler it
    replaced, or None off the main thread, where handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def leave(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, leave)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a benchmark that drives a server: a running one (--base-url,
    --api-key) or the one it starts (--model, --device, --ready-timeout)."""
    parser.add_argument("--base-url", help="a running server on loopback (default: start one)")
    parser.add_argument("--api-key", default="bench")
    parser.add_argument("--model", help="--model of the started server (default: embedded)")
    parser.add_argument("--device", help="--device of the started server")
    parser.add_argument("--ready-timeout", type=float, default=300.0)


def model_args(args: Any) -> list[str]:
    """--model/--device of a benchmark's arguments, for the server it starts."""
    out = []
    if getattr(args, "model", None):
        out += ["--model", args.model]
    if getattr(args, "device", None):
        out += ["--device", args.device]
    return out
