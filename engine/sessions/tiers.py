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

from engine.memory.session import SessionMemory
from engine.protocol import MemoryBudgetExceeded
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


def check_disk_room(memory: SessionMemory, tokens: int, session_ram_bytes: int) -> None:
    """A document of `tokens` that takes memory to the disk tier (past session_ram_bytes, or
    there already) needs room there: MemoryBudgetExceeded, reading nothing, when the tier has
    not got it. Growing in RAM instead is only the fallback of a race, not a way around the
    tier's bound."""
    arena = memory.disk_arena
    if arena is None:
        return
    grows = tokens * memory.memory_row_bytes()
    after = memory.memory_nbytes() + grows
    if memory.on_disk or memory.config.tier == "disk":
        need = grows
    elif session_ram_bytes and after > session_ram_bytes:
        need = after  # spilling copies the blocks held so far too
    else:
        return
    room = max(arena.budget - arena.used, 0)
    if need > room:
        raise MemoryBudgetExceeded(
            f"the server's disk tier for memory blocks has {room} bytes free; this document"
            f" needs {need}",
            needed=need,
            room=room,
        )
