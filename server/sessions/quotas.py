"""Per-tenant and per-session limits, checked before anything changes: each raises a 429
`limit_reached` APIError (its code names the limit) and leaves the sessions as they were.

Tenant-wide figures are the larger of this replica's view and the memory store's usage
ledger (`ledger`, usage.py), so a tenant's other replicas count too."""

from __future__ import annotations

from collections.abc import Mapping

from server.errors import limit_reached
from server.sessions.models import Document, Session
from server.settings import ServerSettings


def memory_tokens(sessions: list[Session]) -> int:
    return sum(s.memory_tokens for s in sessions)


def check_session_count(settings: ServerSettings, held: int) -> None:
    """`held`: the tenant's sessions, those being created included."""
    if held >= settings.max_sessions_per_tenant:
        raise limit_reached(
            "session_limit",
            f"This API key already holds {settings.max_sessions_per_tenant} sessions, the "
            "most allowed; delete one (DELETE /v1/sessions/{id}) first.",
        )


def check_document_room(
    settings: ServerSettings,
    session: Session,
    tenant_sessions: list[Session],
    size_bytes: int,
    ledger: Mapping[str, int] | None = None,
) -> None:
    """Room for one more document of `size_bytes` in `session`, among the tenant's sessions
    (those of every replica, by the `ledger`'s totals)."""
    if len(session.documents) >= settings.max_documents_per_session:
        raise limit_reached(
            "document_limit",
            f"The session already holds {settings.max_documents_per_session} documents, "
            "the most allowed; start a new session.",
        )
    used = max(memory_tokens(tenant_sessions), (ledger or {}).get("memory_tokens", 0))
    if used >= settings.max_memory_tokens_per_tenant:
        raise limit_reached(
            "memory_limit",
            f"This API key's sessions hold {used} memory tokens, the most allowed is "
            f"{settings.max_memory_tokens_per_tenant}; delete a session first.",
        )
    pending = sum(s.pending_bytes for s in tenant_sessions)
    if pending + size_bytes > settings.max_pending_document_bytes_per_tenant:
        raise limit_reached(
            "ingest_queue_full",
            f"{pending} bytes of this API key's documents are still waiting to be read; "
            "retry when they are ready.",
        )


def check_memory_budget(
    settings: ServerSettings, doc: Document, tenant_sessions: list[Session]
) -> None:
    """The whole of `doc` (as far as its size is known) still fits the tenant's memory."""
    limit = settings.max_memory_tokens_per_tenant
    others = memory_tokens(tenant_sessions) - doc.tokens_done
    needed = doc.tokens_total or 0
    if others + needed > limit:
        raise limit_reached(
            "memory_limit",
            f"The document has {needed} tokens; this API key's sessions already hold "
            f"{others} of the {limit} memory tokens allowed.",
        )


def check_collection_count(settings: ServerSettings, session: Session) -> None:
    if len(session.collections) >= settings.max_collections_per_session:
        raise limit_reached(
            "collection_limit",
            f"The session already has {settings.max_collections_per_session} "
            "collections attached, the most allowed.",
        )
