"""The CPU kernels' builder: a lock left by a killed build does not block later builds."""

from __future__ import annotations

import os
import time

from engine.runner.cpu_extensions import STALE_LOCK_SECONDS, clear_stale_lock


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
