"""A tenant's sessions counted in the memory store's usage ledger (memory_store/usage.py), so
that the session and memory limits hold across replicas, whichever one a client picks, and
after restores. Each session is one ledger item (its id) holding 1 session, its documents,
their stored bytes and its memory tokens.

Every check also takes this replica's own view as a floor (quotas.py), and with no store the
local view is all there is. The one decrement is `SessionStore.delete` (records.py), which
deletion, expiry and any sweep go through.
"""

from __future__ import annotations

from collections.abc import Callable

from memory_store.errors import StoreError
from server.errors import limit_reached
from server.sessions.models import Session
from server.sessions.records import SessionStore
from server.settings import ServerSettings

OnTotals = Callable[[str, dict[str, int]], None]  # (tenant, ledger totals): the metric


class SessionUsage:
    """The session side of the ledger. `store` None: nothing is counted beyond this replica."""

    def __init__(
        self, store: SessionStore | None, settings: ServerSettings, on_totals: OnTotals
    ) -> None:
        self.store = store
        self.settings = settings
        self.on_totals = on_totals

    def _amounts(self, session: Session, extra_tokens: int = 0) -> dict[str, int]:
        docs = [d for d in session.documents.values() if d.status != "failed"]
        return {
            "sessions": 1,
            "documents": len(docs),
            "document_bytes": sum(d.size_bytes for d in docs),
            "memory_tokens": session.memory_tokens + extra_tokens,
        }

    async def claim(self, session: Session, extra_tokens: int = 0) -> None:
        """Count `session` as it is (plus `extra_tokens` about to be read) in its tenant's
        ledger; 429 when that would take the tenant past a limit, and nothing is counted."""
        if self.store is None:
            return
        settings = self.settings
        limits = {
            "sessions": settings.max_sessions_per_tenant,
            "memory_tokens": settings.max_memory_tokens_per_tenant,
        }
        result = await self.store.client.claim_usage(
            session.tenant, session.id, self._amounts(session, extra_tokens), limits
        )
        self.on_totals(session.tenant, result.totals)
        if result.refused == "sessions":
            raise limit_reached(
                "session_limit",
                f"This API key already holds {settings.max_sessions_per_tenant} sessions, the "
                "most allowed; delete one (DELETE /v1/sessions/{id}) first.",
            )
        if result.refused is not None:
            held = result.totals.get("memory_tokens", 0)
            raise limit_reached(
                "memory_limit",
                f"This API key's sessions hold {held} memory tokens; the most allowed is "
                f"{settings.max_memory_tokens_per_tenant}. Delete a session first.",
            )

    async def update(self, session: Session) -> None:
        """Best effort: the ledger follows what the session now holds (a document read or
        failed). Never refused: it only records what is already there."""
        if self.store is None or session.removed:
            return
        try:
            result = await self.store.client.claim_usage(
                session.tenant, session.id, self._amounts(session)
            )
            self.on_totals(session.tenant, result.totals)
        except StoreError:
            pass  # the next claim or update of the session counts it

    async def release(self, tenant: str, session_id: str) -> None:
        """Uncount a session that was never made (a create that failed after its claim)."""
        if self.store is None:
            return
        self.on_totals(tenant, await self.store.client.release_usage(tenant, session_id))

    async def totals(self, tenant: str) -> dict[str, int]:
        """The tenant's ledger totals; {} with no store (the local view stands alone)."""
        if self.store is None:
            return {}
        totals = await self.store.client.usage(tenant)
        self.on_totals(tenant, totals)
        return totals
