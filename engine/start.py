"""Building the engine on a thread of its own, so that the device thread is the only live thread
that has run parallel torch work (docs/decisions/034)."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from engine.client import LocalEngine
from engine.config import EngineConfig
from memory_store.client import MemoryStoreClient


def start_engine(config: EngineConfig, store: MemoryStoreClient | None = None) -> LocalEngine:
    """A LocalEngine built on a thread that ends once it is built, so that the device thread is
    the only live thread that has run parallel torch work. Loading runs OpenMP parallel
    regions; the team a live thread keeps outnumbers this machine's cores next to the device
    thread's, libgomp then stops spinning between regions, and every small matmul of a
    decode step waits to wake its threads: a step took 30 ms instead of 19 ms here
    (docs/decisions/034)."""
    built: dict[str, Any] = {}
    if config.threads:
        torch.set_num_threads(config.threads)
    # tokenizers' own thread pool would take every core for one prompt, at the caller's
    # priority, not the preprocessing thread's (docs/decisions/061); an operator may set it
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def build() -> None:
        try:
            built["engine"] = LocalEngine(config, store=store)
        except BaseException as e:  # re-raised on the caller's thread
            built["error"] = e

    loader = threading.Thread(target=build, name="longserve-load")
    loader.start()
    loader.join()
    if "error" in built:
        raise built["error"]
    engine: LocalEngine = built["engine"]
    return engine
