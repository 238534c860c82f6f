"""The images the stack runs, made on a machine without Docker Hub.

- `longserve-test/python:3.11-bookworm`: Debian bookworm's Python 3.11 (debootstrap, then
  `docker import`), standing in for `python:3.11-slim-bookworm` as the Dockerfile's base.
- `longserve-test/services:forky`: Debian's nginx, Redis and Prometheus, standing in for the
  official redis, nginx and prom/prometheus images (the compose override says how each runs).
  Debian's next release (forky), because deploy/nginx.conf needs nginx >= 1.27.3 (`resolve`).
- `longserve:cpu`: the project's Dockerfile, the production build path, with build args for the
  base image and package sources (tests/stack/package_proxy.py).

Made once per machine: an image already there is kept (`docker image rm` to rebuild)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.stack.engine import run
from tests.stack.package_proxy import PackageProxy

REPO = Path(__file__).resolve().parents[2]
MIRROR = "http://deb.debian.org/debian"
PYTHON_IMAGE = "longserve-test/python:3.11-bookworm"
SERVICES_IMAGE = "longserve-test/services:forky"
PROJECT_IMAGE = "longserve:cpu"


@dataclass
class Built:
    image: str
    seconds: float  # 0 when it was already there
    size_bytes: int


def exists(image: str) -> bool:
    return (
        subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0
    )


def size(image: str) -> int:
    return int(run("docker", "image", "inspect", "-f", "{{.Size}}", image).stdout.strip())


def _debootstrap_image(image: str, suite: str, packages: list[str], changes: list[str]) -> None:
    script = Path("/usr/share/debootstrap/scripts") / suite
    if not script.exists():  # an older debootstrap knows the next release as testing, i.e. sid
        script = script.with_name("sid")
    with tempfile.TemporaryDirectory(prefix="longserve-rootfs-") as root:
        run("debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
            suite, root, MIRROR, str(script), timeout=1200)  # fmt: skip
        shutil.rmtree(Path(root) / "var/cache/apt/archives", ignore_errors=True)
        args = [arg for change in changes for arg in ("--change", change)]
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        run("docker", "import", *args, "-", image, stdin=tar.stdout, timeout=600)
        tar.wait()


def _base(image: str, suite: str, packages: list[str], changes: list[str]) -> Built:
    """The image from Debian's packages, unless it is already there (then 0 seconds)."""
    start = time.monotonic()
    made = not exists(image)
    if made:
        _debootstrap_image(image, suite, packages, changes)
    return Built(image, time.monotonic() - start if made else 0.0, size(image))


def python_base() -> Built:
    return _base(
        PYTHON_IMAGE, "bookworm",
        # the headers too, as the official image has them: the CPU kernels build against them
        ["python3", "python3-venv", "python-is-python3", "libpython3-dev", "ca-certificates"],
        ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
         "ENV LANG=C.UTF-8", 'CMD ["python3"]'],
    )  # fmt: skip


def services() -> Built:
    return _base(
        SERVICES_IMAGE, "forky",
        ["nginx-light", "redis-server", "prometheus", "wget", "ca-certificates"],
        ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
    )  # fmt: skip


def cpu_capability() -> str:
    """The x86 vector level torch uses here: the image builds its kernels for that one only."""
    import torch

    return "avx512" if "AVX512" in torch.backends.cpu.get_cpu_capability() else "avx2"


def project(log: Path) -> Built:
    """`docker build` of the Dockerfile as a user runs it, but for the base image and sources."""
    start = time.monotonic()
    with PackageProxy() as packages:
        cmd = ["docker", "build", "--network", "host", "-t", PROJECT_IMAGE,
               "--build-arg", f"PYTHON_IMAGE={PYTHON_IMAGE}",
               "--build-arg", f"PIP_INDEX_URL={packages.url}/simple",
               "--build-arg", "PIP_TRUSTED_HOST=127.0.0.1",
               "--build-arg", f"TORCH_CPU_INDEX={packages.url}/simple",
               "--build-arg", f"CPU_CAPABILITIES={cpu_capability()}",
               str(REPO)]  # fmt: skip
        with log.open("w") as out:
            done = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, timeout=2400,
                env={**os.environ, "DOCKER_BUILDKIT": "0"},  # the builder every engine has
            )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(f"docker build failed:\n{log.read_text(errors='replace')[-6000:]}")
    return Built(PROJECT_IMAGE, time.monotonic() - start, size(PROJECT_IMAGE))
