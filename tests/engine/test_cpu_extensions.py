"""The CPU kernels' builder: a lock left by a killed build does not block later builds, every
process builds with the same ninja, and the image's build step builds every kernel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.runner import cpu_extensions
from engine.runner.cpu_extensions import STALE_LOCK_SECONDS, clear_stale_lock, one_ninja


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "stale_ext" / "lock", tmp_path / "fresh_ext" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - STALE_LOCK_SECONDS - 60
    os.utime(stale, (old, old))
    assert clear_stale_lock("stale_ext") and not stale.exists()
    assert not clear_stale_lock("fresh_ext") and fresh.exists()
    assert not clear_stale_lock("no_such_ext")


def test_every_build_runs_the_ninja_package_s_program(tmp_path, monkeypatch):
    import ninja

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # a system ninja, if any, comes first here
    with one_ninja():
        first = os.environ["PATH"].split(os.pathsep)[0]
        assert os.listdir(first) == ["ninja"]  # only ninja: no other program is shadowed
        found = shutil.which("ninja")
        assert found and Path(found).resolve() == (Path(ninja.BIN_DIR) / "ninja").resolve()
    assert os.environ["PATH"] == "/usr/bin:/bin"
    with one_ninja():  # a second build finds its link in place
        assert shutil.which("ninja") == found


@pytest.mark.timeout(900)  # on a fresh machine it builds all five (2-3 min here)
def test_the_build_step_builds_every_kernel_or_fails_naming_it(monkeypatch):
    """`python -m engine.runner.cpu_extensions` (the image's build step) builds every csrc
    kernel; `build_all` names those that did not build, which the step exits non-zero on."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the kernels cannot build here")
    done = subprocess.run([sys.executable, "-m", "engine.runner.cpu_extensions"],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert ", ".join(cpu_extensions.STEMS) in done.stderr
    monkeypatch.setattr(cpu_extensions, "_built", {"token_search": None})
    monkeypatch.setattr(cpu_extensions, "STEMS", ("token_search",))
    assert cpu_extensions.build_all() == ["token_search"]


def test_a_change_to_an_included_source_changes_the_build_flag(tmp_path, monkeypatch):
    """plain_step.cpp includes decode_attention.cpp: torch's builder hashes only the sources it
    is given, so the headers digest (a build flag) must cover the included source too."""
    for source in ("outer.cpp", "inner.cpp", "alone.cpp"):
        (tmp_path / source).write_text("// a kernel\n")
    (tmp_path / "outer.cpp").write_text('#include "inner.cpp"\n')
    monkeypatch.setattr(cpu_extensions, "_CSRC", tmp_path)
    assert cpu_extensions.included_sources() == [tmp_path / "inner.cpp"]
    before = cpu_extensions.headers_digest()
    (tmp_path / "alone.cpp").write_text("// changed, and built from itself\n")
    assert cpu_extensions.headers_digest() == before
    (tmp_path / "inner.cpp").write_text("// changed\n")
    assert cpu_extensions.headers_digest() != before
