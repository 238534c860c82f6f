"""Sessions and their documents: the per-tenant registry, background ingestion, TTL eviction.

A session lives in two places: here (owner, documents, TTL, quotas) and in the engine (its
memory, under `tenant_session_id(tenant, id)`). Each uploaded document becomes one asyncio task
that waits for the session's previous document, then streams `engine.ingest` progress into the
document's status (queued -> ingesting -> ready | failed). Deleting or evicting a session
cancels its tasks (which closes the engine's ingest iterators) and drops its engine memory.

Another tenant's session is indistinguishable from a missing one: every lookup is keyed by
(tenant, id) and answers 404 `session_not_found`.

With a memory store (records.py) a session is also durable, so that it survives a
restart and any replica can serve it: creating it, uploading a document (its text) and a
document becoming ready each return only once the store holds the change. A request naming a
session this registry does not hold restores it from the store (restore.py). While the store
is down, held sessions keep serving chat; operations that need the store answer 503
`memory_store_unavailable`.

Rooms: models.py (what is held), registry.py (SessionRegistry), listing.py, ingestion.py
(documents), attachments.py (collections), restore.py, quotas.py, sweeper.py (TTL), turns.py,
records.py (the durable records in the memory store). The registry hands its helpers what
they use (context.py: the services, the table of held sessions, and lookup/touch/remove as
callables), never itself, so no helper imports registry.py.
"""

from server.sessions.listing import list_session_views
from server.sessions.models import AttachedCollection, Document, Session, stored_view
from server.sessions.registry import SessionRegistry

__all__ = [
    "AttachedCollection",
    "Document",
    "Session",
    "SessionRegistry",
    "list_session_views",
    "stored_view",
]
