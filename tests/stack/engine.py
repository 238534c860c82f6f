"""A Docker engine for the stack test: the running one, else Debian's docker.io installed and
dockerd started here (as root, with apt-get), else a reason to skip that says what is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

PACKAGES = {
    "dockerd": "docker.io",
    "docker-compose": "docker-compose",
    "debootstrap": "debootstrap",
}


def run(*cmd: str, timeout: float = 600, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """A command whose failure fails the test with its output."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        )
    return done


def _engine_answers() -> bool:
    if not shutil.which("docker"):
        return False
    done = subprocess.run(["docker", "info"], capture_output=True, timeout=60)
    return done.returncode == 0


def ensure_engine(log_dir: Path) -> str | None:
    """None once `docker info` answers and docker-compose and debootstrap are here; else why not."""
    missing = [package for tool, package in PACKAGES.items() if not shutil.which(tool)]
    if missing:
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            return f"missing {', '.join(missing)}, and no root with apt-get to install them"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if done.returncode != 0:
                return f"`{' '.join(cmd)}` failed: {done.stderr[-2000:]}"
    if _engine_answers():
        return None
    if os.geteuid() != 0:
        return "no Docker engine answers, and starting dockerd needs root"
    log = (log_dir / "dockerd.log").open("ab")
    subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if _engine_answers():
            return None
        time.sleep(1)
    tail = (log_dir / "dockerd.log").read_text(errors="replace")[-3000:]
    return f"dockerd did not start within 90 s:\n{tail}"
