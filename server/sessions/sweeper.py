"""TTL eviction: a background task that evicts sessions idle past their TTL, here and (unless
another replica has used them since) in the memory store; and, every
store_reclaim_interval_seconds, the store's own sweep (sessions expired whichever replica held
them, chunks nothing names: memory_store/reclaim.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

from memory_store.errors import StoreError
from server.sessions.context import HeldSessions, Remove, SessionServices
from server.sessions.models import Session

logger = logging.getLogger(__name__)


class SessionSweeper:
    """Sweeps the held sessions every session_sweep_interval_seconds, between start() and
    stop(); `remove` is the registry's (forget here, cancel ingestion, free the memory)."""

    def __init__(
        self,
        services: SessionServices,
        held: HeldSessions,
        remove: Remove,
        on_reclaimed: Callable[[Mapping[str, int]], None] | None = None,
    ) -> None:
        self.services = services
        self._held = held
        self._remove = remove
        self._on_reclaimed = on_reclaimed
        self._last_reclaim = services.clock()
        self._task: asyncio.Task[None] | None = None

    async def sweep(self) -> list[str]:
        """Evict sessions idle past their TTL (a session still reading documents is busy, not
        idle). Returns the evicted ids."""
        now = self.services.clock()
        expired = [
            session
            for session in self._held.all()
            if not session.ingesting() and now - session.last_used >= session.ttl_seconds
        ]
        for session in expired:
            await self._remove(session, "The session expired.")
            await self._forget_if_expired(session)
        return [session.id for session in expired]

    async def _forget_if_expired(self, session: Session) -> None:
        """Delete an evicted session from the store too, unless another replica has used it
        since (its stored last_used says so)."""
        store = self.services.store
        if store is None:
            return
        try:
            if session.saving is not None:
                await asyncio.wait([session.saving])
            record = await store.load(session.tenant, session.id)
            if record is None or record.expired(self.services.clock()):
                await store.delete(session.tenant, session.id)
        except StoreError as exc:
            logger.info("forgetting expired session %s failed: %s", session.id, exc)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._sweep_forever(), name="session-sweeper")

    async def _sweep_forever(self) -> None:
        interval = self.services.settings.session_sweep_interval_seconds
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sweep()
                await self.reclaim_if_due()
            except Exception:
                logger.exception("session sweep failed")

    async def reclaim_if_due(self, *, force: bool = False) -> Mapping[str, int] | None:
        """The store's sweep, once every store_reclaim_interval_seconds (0: never); what it
        deleted, or None when it did not run."""
        settings = self.services.settings
        interval = settings.store_reclaim_interval_seconds
        store = self.services.store
        now = self.services.clock()
        if store is None or not interval or (not force and now - self._last_reclaim < interval):
            return None
        self._last_reclaim = now
        try:
            report = await store.client.reclaim(settings.store_chunk_grace_seconds)
        except StoreError as exc:
            logger.info("memory store sweep failed: %s", exc)
            return None
        if self._on_reclaimed is not None:
            self._on_reclaimed(report)
        return report

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
