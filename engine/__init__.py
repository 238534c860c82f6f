"""The model and its memory, by role: `protocol` (the contract the server calls), `client`
(LocalEngine, which implements it) and `config` at the top; `runner/` runs the model, `memory/`
is the memory attention's strategies, `sessions/` the session backends, `caches/` the prefix
caches and the memory store's I/O, `scheduler/` the thread that owns the device. The design is
docs/architecture.md. Import-light: `import engine` loads no torch; the names below are
imported on first use."""

from __future__ import annotations

from typing import Any

_LAZY = {
    "EngineConfig": "engine.config",
    "LocalEngine": "engine.client",
    "LoadedModel": "engine.runner.loader",
    "load_model": "engine.runner.loader",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
