"""Hand the C heap's free pages back to the system once the engine goes idle.

A request frees what it allocated, but glibc keeps freed heap pages for reuse: a server that had
read a 14K-token document held 0.7 GB of them, returned by one `malloc_trim(0)`
(docs/decisions/084). Elsewhere (musl, macOS) there is nothing to trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

_libc: Any = None  # the C library with malloc_trim, False where there is none


def trim_heap() -> bool:
    """Return the heap's free pages to the system (glibc's malloc_trim); False where the C
    library has no such call."""
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = libc if hasattr(libc, "malloc_trim") else False
        except OSError:
            _libc = False
    if not _libc:
        return False
    started = time.perf_counter()
    _libc.malloc_trim(0)
    logger.debug("heap trimmed in %.1f ms", (time.perf_counter() - started) * 1000)
    return True
