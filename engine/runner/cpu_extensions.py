"""Builds the engine's C++ CPU kernels (engine/runner/csrc/*.cpp) on first use.

Each source is compiled with torch's C++ extension builder (ninja and a C++ compiler) into
torch's extension cache (TORCH_EXTENSIONS_DIR), once per CPU capability. `load_extension`
returns None, with one warning, where that is impossible; callers then use torch's own ops.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_lock = threading.Lock()
_built: dict[str, Any] = {}  # stem -> module, or None where building failed
# Vector extensions by torch's own CPU capability, never -march=native: a build cached in an
# image must run on any machine that reports the same capability.
_ARCH = {"AVX2": ["-march=x86-64-v3"], "AVX512": ["-march=x86-64-v4"]}
# A build takes a minute or two; a lock older than this was left by a process killed mid-build
STALE_LOCK_SECONDS = 15 * 60
# Every kernel there is: an image builds them all (`python -m engine.runner.cpu_extensions`)
STEMS = tuple(sorted(source.stem for source in _CSRC.glob("*.cpp")))


def load_extension(stem: str) -> Any | None:
    """The compiled module of engine/runner/csrc/<stem>.cpp, built on the first call; None if it
    cannot be. Lock-free once tried."""
    if stem in _built:
        return _built[stem]
    with _lock:
        if stem not in _built:
            _built[stem] = _build(stem)
        return _built[stem]


def build_all() -> list[str]:
    """Build every kernel for torch's CPU capability; the stems that did not build."""
    return [stem for stem in STEMS if load_extension(stem) is None]


def _build(stem: str) -> Any | None:
    try:
        from torch.utils.cpp_extension import load

        capability = torch.backends.cpu.get_cpu_capability()
        name = f"longserve_{stem}_{capability.lower()}"
        clear_stale_lock(name)
        with one_ninja():
            return load(
                name=name,
                sources=[str(_CSRC / f"{stem}.cpp")],
                extra_cflags=[
                    "-O3",
                    *_ARCH.get(capability, []),
                    "-fopenmp",
                    "-ffast-math",
                    f"-DLONGSERVE_HEADERS={headers_digest()}",  # a header's change rebuilds
                ],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as exc:  # no compiler or ninja: torch's own ops do the work instead
        logger.warning("CPU kernel %s unavailable (%s); using torch's ops", stem, exc)
        return None


@contextlib.contextmanager
def one_ninja() -> Iterator[None]:
    """torch's builder runs `ninja` from PATH. Two versions (the `ninja` package this project
    installs, and a system one) log build commands under different hashes, so processes that
    alternate between them rebuild every kernel (about 30 s each: a README example's
    `longserve ingest` took 100 s so; docs/decisions/087). During a build, PATH starts with a
    directory holding only the package's ninja, the same in every process."""
    try:
        import ninja
        from torch.utils.cpp_extension import get_default_build_root
    except ImportError:
        yield
        return
    program = Path(ninja.BIN_DIR) / "ninja"
    directory = Path(get_default_build_root()) / "longserve-ninja"
    link = directory / "ninja"
    try:
        if not link.exists() or link.resolve() != program.resolve():
            directory.mkdir(parents=True, exist_ok=True)
            spare = directory / f"ninja.{os.getpid()}"
            spare.unlink(missing_ok=True)
            spare.symlink_to(program)
            spare.replace(link)  # atomic: another process building at once sees one or the other
    except OSError as exc:
        logger.warning("cannot link the ninja package's program (%s); using PATH's", exc)
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{directory}{os.pathsep}{path}"
    try:
        yield
    finally:
        os.environ["PATH"] = path


def headers_digest() -> str:
    """A digest of csrc's headers and of the sources another source includes (plain_step.cpp
    includes two): torch's builder versions a build by its own sources and flags only, so an
    included file's change reaches a cached build through this flag."""
    digest = hashlib.sha256()
    for header in sorted(_CSRC.glob("*.h")) + included_sources():
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


def included_sources() -> list[Path]:
    """csrc's .cpp files that another source #includes, sorted."""
    named = set()
    for source in _CSRC.glob("*.cpp"):
        named.update(re.findall(r'^#include "(\w+\.cpp)"', source.read_text(), re.MULTILINE))
    return sorted(_CSRC / name for name in named)


def clear_stale_lock(name: str) -> bool:
    """Remove extension `name`'s build lock if it is older than STALE_LOCK_SECONDS: a process
    killed mid-build leaves it, and torch's builder then waits on it forever (a test run hung
    so). True if one was removed."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        if time.time() - lock.stat().st_mtime < STALE_LOCK_SECONDS:
            return False
        lock.unlink()
    except (OSError, ImportError):  # no lock (the usual case), or torch moved its helper
        return False
    logger.warning("removed a stale build lock of CPU kernel %s (%s)", name, lock)
    return True


if __name__ == "__main__":  # the image's build step: fail where a kernel does not build
    logging.basicConfig(level=logging.INFO)
    failed = build_all()
    if failed:
        raise SystemExit(f"CPU kernels that did not build: {', '.join(failed)}")
    logger.info("built %s for %s", ", ".join(STEMS), torch.backends.cpu.get_cpu_capability())
