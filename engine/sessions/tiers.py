"""Which tier an idle session's memory sits in: worker housekeeping, on the device thread.

A session idle for session_offload_after_s moves to host memory (SessionMemory.offload); while
the sessions' memory blocks held in RAM pass memory_ram_bytes, the least recently used idle
session moves its blocks to the disk tier (engine/memory/mapped.py,
docs/decisions/077-memory-on-disk.md). A session with a request or ingestion in flight is
busy: it is left alone, and counts as used now.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from engine.sessions.conversation import Conversation

logger = logging.getLogger(__name__)


def offload_idle(sessions: Mapping[str, Conversation], busy: set[str], after_s: float) -> None:
    """Move sessions idle for after_s seconds (0: never) to host memory; their next append
    brings them back."""
    now = time.monotonic()
    for session_id, session in list(sessions.items()):
        if session_id in busy:
            session.last_used = now
        elif after_s > 0 and not session.memory.offloaded and now - session.last_used >= after_s:
            session.memory.offload()
            logger.info("session %s idle: its memory moved to host memory", session_id)


def spill_past_budget(sessions: Mapping[str, Conversation], busy: set[str], budget: int) -> None:
    """While the memory blocks in RAM pass budget bytes (0: no bound), move the least recently
    used idle session's blocks to the disk tier. A busy session spills on its own, past
    session_ram_bytes."""
    if not budget:
        return
    held = {sid: s.memory.memory_nbytes() for sid, s in sessions.items() if not s.memory.on_disk}
    total = sum(held.values())
    for _, sid in sorted((sessions[sid].last_used, sid) for sid in held if sid not in busy):
        if total <= budget:
            return
        if not sessions[sid].memory.spill():
            logger.warning("the disk tier is full: session %s stays in RAM", sid)
            return
        total -= held[sid]
        logger.info("session %s idle past memory_ram_bytes: its blocks moved to disk", sid)
