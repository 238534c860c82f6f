"""One parse of a GGUF file while a model loads. transformers builds a new `gguf.GGUFReader` for
the tokenizer, the config and the weights, and engine/runner/gguf_grids.py two more; each reads
the embedded file's 49K-token vocabulary field by field (about 3 s on a 2-core CPU). It also
rebuilds gguf's tensor-name map for every module (397 times). Inside `parsed_once()` both are
made once per file and architecture: the embedded model loads in 11-14 s instead of 30-34 s
(docs/decisions/087-one-gguf-parse-per-load.md)."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_lock = threading.RLock()  # one load at a time patches gguf's module, and restores it


@contextmanager
def parsed_once() -> Iterator[None]:
    """While inside, `gguf.GGUFReader(path)` returns one reader per (path, mode) and
    `gguf.get_tensor_name_map` one map per (architecture, blocks). Readers are read-only views
    of the file; they are dropped on leaving, and gguf's own functions are put back."""
    import gguf

    with _lock:
        make_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, Any], Any] = {}

        def reader(path: Any, mode: Any = "r") -> Any:
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = make_reader(path, mode)
            return readers[key]

        setattr(gguf, "GGUFReader", reader)  # noqa: B010 - gguf's own name, looked up per call
        setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(name_map))  # noqa: B010
        try:
            yield
        finally:
            setattr(gguf, "GGUFReader", make_reader)  # noqa: B010
            setattr(gguf, "get_tensor_name_map", name_map)  # noqa: B010
            readers.clear()
