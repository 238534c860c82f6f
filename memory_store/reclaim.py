"""The store gives back what nothing uses (issue #41 item 3; docs/decisions/059).

- Deleting a session deletes its hash tag (records, texts, turns, manifests, Larimar memory),
  then the chunks its manifests named that no other manifest of its tenant (chunks are shared
  within a tenant only, engine/caches/store.py) and no collection names.
- `sweep` expires sessions by their stored record (`expires_at`, else `last_used +
  ttl_seconds`), whichever replica held them, and deletes their tenant-index entry; then it
  marks every chunk a manifest or a collection names and deletes the others idle past
  `chunk_grace_s` (the prefix store's chunks, which nothing names, live that long after their
  last write, or on Redis their last read; the grace also covers a document still being read,
  whose manifest comes after its chunks).

Every step is idempotent, so replicas and the memory service may sweep at once. A chunk deleted
under a session that is about to name it costs a forward when that session is restored (its
text is stored), never a document.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from memory_store.backends.base import Backend
from memory_store.errors import NotFound, StoreError
from memory_store.keys import Key, KeySpace

logger = logging.getLogger(__name__)

SESSION_RECORD = "session"  # the server's session record (server/sessions/records.py)
# (tenant, session id) of a session the sweep expired: the usage ledger's decrement. The server
# releases what it deletes itself (SessionStore.delete); only the store's own expiry needs this.
SessionExpired = Callable[[str, str], Awaitable[None]]


@dataclass
class ReclaimReport:
    """What one delete or sweep gave back."""

    sessions_deleted: int = 0
    keys_deleted: int = 0  # records and blobs under deleted sessions
    chunks_deleted: int = 0
    bytes_reclaimed: int = 0

    def add(self, other: ReclaimReport) -> None:
        self.sessions_deleted += other.sessions_deleted
        self.keys_deleted += other.keys_deleted
        self.chunks_deleted += other.chunks_deleted
        self.bytes_reclaimed += other.bytes_reclaimed

    def to_record(self) -> dict[str, int]:
        return {
            "sessions_deleted": self.sessions_deleted,
            "keys_deleted": self.keys_deleted,
            "chunks_deleted": self.chunks_deleted,
            "bytes_reclaimed": self.bytes_reclaimed,
        }


def tenant_of_session(session_id: str) -> str | None:
    """`T` of a server session's store id `T.S` (server/auth.tenant_session_id)."""
    tenant, dot, _ = session_id.partition(".")
    return tenant if dot and tenant else None


class Reclaimer:
    """Deletes sessions with what only they use, and sweeps what nothing uses."""

    def __init__(
        self,
        backend: Backend,
        *,
        clock: Callable[[], float] = time.time,
        on_session_expired: SessionExpired | None = None,
    ) -> None:
        self.backend = backend
        self.clock = clock
        # The usage ledger's release (memory_store/usage.py): an expired session is uncounted.
        self.on_session_expired = on_session_expired

    async def delete_session(self, session_id: str) -> ReclaimReport:
        """The session's tag, then the chunks only it named."""
        tag = KeySpace.session_tag(session_id)
        named = await self._manifest_chunks([tag])
        keys, size = await self._delete_tag(tag)
        report = ReclaimReport(int(keys > 0), keys, 0, size)
        if named:
            tenant = tenant_of_session(session_id)
            siblings = await self._sibling_tags(tenant, session_id)
            kept = await self._manifest_chunks(siblings) | await self._collection_chunks()
            for fingerprint, chain_hash in sorted(named - kept):
                report.add(await self._delete_chunk(fingerprint, chain_hash))
        return report

    async def drop_unnamed_chunks(
        self, session_id: str, chunks: Iterable[tuple[str, str]]
    ) -> ReclaimReport:
        """Chunks a reading of `session_id` put and never named (cut short before its
        manifest): those that no manifest of the tenant's sessions, this one's included, and no
        collection names go now rather than after the grace sweep."""
        candidates = set(chunks)
        if not candidates:
            return ReclaimReport()
        tenant = tenant_of_session(session_id)
        tags = [KeySpace.session_tag(session_id), *await self._sibling_tags(tenant, session_id)]
        kept = await self._manifest_chunks(tags) | await self._collection_chunks()
        report = ReclaimReport()
        for fingerprint, chain_hash in sorted(candidates - kept):
            report.add(await self._delete_chunk(fingerprint, chain_hash))
        return report

    async def _sibling_tags(self, tenant: str | None, session_id: str) -> list[str]:
        """The tags of the sessions that may share the session's chunks: its tenant's, from the
        tenant index when that names it (a server session: no scan of the store), else by a
        scan (engine-only sessions, or a delete finishing one cut short)."""
        if tenant is None:
            return await self.backend.list_tags(f"{KeySpace.SESSION}:")
        index = KeySpace.namespace_tag(f"tenant:{tenant}")
        paths = await self.backend.list_paths(index, KeySpace.RECORD_PREFIX)
        sids = [p[len(KeySpace.RECORD_PREFIX) :] for p in paths]
        if session_id.partition(".")[2] not in sids:
            return await self.backend.list_tags(KeySpace.session_tag(tenant) + ".")
        return [KeySpace.session_tag(f"{tenant}.{sid}") for sid in sids]

    async def sweep(self, chunk_grace_s: float) -> ReclaimReport:
        """Expired sessions, then unnamed chunks idle past `chunk_grace_s`."""
        report = ReclaimReport()
        now = self.clock()
        for tag in await self.backend.list_tags(f"{KeySpace.SESSION}:"):
            try:
                report.add(await self._expire(tag, now))
            except StoreError as exc:  # one unreadable session never stops the sweep
                logger.warning("expiring %s failed: %s", tag, exc)
        report.add(await self._drop_stale_index_entries())
        named = await self._collection_chunks()
        named |= await self._manifest_chunks(await self.backend.list_tags(f"{KeySpace.SESSION}:"))
        for tag in await self.backend.list_tags(f"{KeySpace.ENCODING}:"):
            _, fingerprint, chain_hash = tag.split(":", 2)
            if (fingerprint, chain_hash) in named:
                continue
            idle = await self.backend.idle_seconds(KeySpace.chunk(fingerprint, chain_hash))
            if idle is not None and idle >= chunk_grace_s:
                report.add(await self._delete_chunk(fingerprint, chain_hash))
        if report.bytes_reclaimed:
            logger.info("memory store sweep: %s", report.to_record())
        return report

    # Steps ------------------------------------------------------------------------------------

    async def _expire(self, tag: str, now: float) -> ReclaimReport:
        try:
            record = await self.backend.get_record(
                Key(tag, KeySpace.RECORD_PREFIX + SESSION_RECORD)
            )
        except NotFound:
            return ReclaimReport()  # no server session record (an engine-only session): kept
        expires_at = _expires_at(record)
        if expires_at is None or now < expires_at:
            return ReclaimReport()
        session_id = tag.split(":", 1)[1]
        report = await self.delete_session(session_id)
        tenant, sid = record.get("tenant"), record.get("id")
        if isinstance(tenant, str) and isinstance(sid, str):
            try:
                await self.backend.delete(KeySpace.record(f"tenant:{tenant}", sid))
                if self.on_session_expired is not None:
                    await self.on_session_expired(tenant, sid)
            except StoreError as exc:
                logger.info("dropping %s from tenant %s's index failed: %s", sid, tenant, exc)
        return report

    async def _drop_stale_index_entries(self) -> ReclaimReport:
        """Tenant-index entries whose session record is gone (a delete cut short): the server
        writes the record before the entry, so such an entry names nothing to come."""
        report = ReclaimReport()
        for tag in await self.backend.list_tags("tenant:"):
            tenant = tag.split(":", 1)[1]
            for path in await self.backend.list_paths(tag, KeySpace.RECORD_PREFIX):
                sid = path[len(KeySpace.RECORD_PREFIX) :]
                session = Key(
                    KeySpace.session_tag(f"{tenant}.{sid}"),
                    KeySpace.RECORD_PREFIX + SESSION_RECORD,
                )
                try:
                    await self.backend.get_record(session)
                except NotFound:
                    if await self.backend.delete(Key(tag, path)):
                        report.keys_deleted += 1
        return report

    async def _delete_tag(self, tag: str) -> tuple[int, int]:
        """(keys, bytes) deleted under `tag`; (0, 0) when another sweeper got there first."""
        try:
            size = await self.backend.tag_bytes(tag)
            keys = await self.backend.delete_tag(tag)
        except NotFound:
            return 0, 0
        return keys, size if keys else 0

    async def _delete_chunk(self, fingerprint: str, chain_hash: str) -> ReclaimReport:
        keys, size = await self._delete_tag(KeySpace.chunk(fingerprint, chain_hash).tag)
        return ReclaimReport(chunks_deleted=int(keys > 0), bytes_reclaimed=size)

    async def _manifest_chunks(self, tags: Iterable[str]) -> set[tuple[str, str]]:
        named: set[tuple[str, str]] = set()
        for tag in tags:
            for path in await self.backend.list_paths(tag, KeySpace.MANIFEST_PREFIX):
                try:
                    record = await self.backend.get_record(Key(tag, path))
                except NotFound:
                    continue  # deleted meanwhile
                fingerprint = str(record.get("fingerprint", ""))
                named.update((fingerprint, str(h)) for h in record.get("chunk_hashes", ()))
        return named

    async def _collection_chunks(self) -> set[tuple[str, str]]:
        named: set[tuple[str, str]] = set()
        for tag in await self.backend.list_tags(f"{KeySpace.COLLECTION}:"):
            for path in await self.backend.list_paths(tag, KeySpace.COLLECTION_BATCH_PREFIX):
                try:
                    blob = await self.backend.get_blob(Key(tag, path))
                except NotFound:
                    continue
                fingerprint, hashes = _batch_header(blob)
                named.update((fingerprint, h) for h in hashes)
        return named


def _expires_at(record: dict[str, object]) -> float | None:
    try:
        if record.get("expires_at") is not None:
            return float(record["expires_at"])  # type: ignore[arg-type]
        return float(record["last_used"]) + float(record["ttl_seconds"])  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError):
        return None  # not a session record this sweep understands: kept


def _batch_header(blob: bytes) -> tuple[str, list[str]]:
    """A collection batch's (fingerprint, chain hashes) (EncodingStore.add_to_collection)."""
    (head_len,) = struct.unpack("<I", blob[:4])
    head = json.loads(blob[4 : 4 + head_len])
    return str(head["fingerprint"]), [str(h) for h in head["chain_hashes"]]
