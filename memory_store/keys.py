"""Keys: the only place that names them.

A `Key` is a hash tag (everything that must live together: one session, one collection, one
content-addressed chunk) plus a path inside it. `KeySpace` names every key the memory service
uses; each backend maps a `Key` to its own layout (`redis_key` is Redis's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memory_store.errors import InvalidStoreRequest

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_PATH_RE = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")


def validate_id(value: str, what: str) -> str:
    """Ids go into hash tags and file names: letters, digits, `._-`, at most 200 characters."""
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise InvalidStoreRequest(f"invalid {what} {value!r}: use letters, digits, '.', '_', '-'")
    return value


@dataclass(frozen=True, order=True)
class Key:
    """`tag` groups keys that must share a Redis Cluster slot; `path` names one value in it."""

    tag: str
    path: str

    def __post_init__(self) -> None:
        if "{" in self.tag or "}" in self.tag or not self.tag:
            raise InvalidStoreRequest(f"invalid key tag {self.tag!r}")
        if len(self.path) > 400 or not _PATH_RE.match(self.path):
            raise InvalidStoreRequest(f"invalid key path {self.path!r}")


class KeySpace:
    """Every key the memory service uses."""

    SESSION = "sess"
    COLLECTION = "coll"
    ENCODING = "enc"

    @staticmethod
    def session_tag(session_id: str) -> str:
        return f"{KeySpace.SESSION}:{validate_id(session_id, 'session id')}"

    @staticmethod
    def collection_tag(name: str) -> str:
        return f"{KeySpace.COLLECTION}:{validate_id(name, 'collection name')}"

    @staticmethod
    def chunk(fingerprint: str, chain_hash: str) -> Key:
        """One content-addressed chunk; shared by every session that holds the same tokens."""
        fp = validate_id(fingerprint, "model fingerprint")
        h = validate_id(chain_hash, "chain hash")
        return Key(f"{KeySpace.ENCODING}:{fp}:{h}", "chunk")

    @staticmethod
    def manifest(session_id: str, doc_id: str) -> Key:
        return Key(KeySpace.session_tag(session_id), f"doc/{validate_id(doc_id, 'document id')}")

    MANIFEST_PREFIX = "doc/"

    @staticmethod
    def larimar(session_id: str) -> Key:
        return Key(KeySpace.session_tag(session_id), "larimar")

    @staticmethod
    def collection_batch(name: str, batch_id: str) -> Key:
        return Key(KeySpace.collection_tag(name), f"batch/{validate_id(batch_id, 'batch id')}")

    COLLECTION_BATCH_PREFIX = "batch/"

    # Generic records and blobs (memory_store/records.py), grouped in namespaces. A namespace
    # is "<kind>:<id>" and IS a hash tag: "sess:ID" shares the tag of that session's manifests
    # and Larimar memory, so deleting the session deletes its records too.
    NAMESPACE_KINDS = (SESSION, "tenant")
    RECORD_PREFIX = "rec/"
    BLOB_PREFIX = "blob/"

    @staticmethod
    def namespace_tag(namespace: str) -> str:
        kind, sep, ident = namespace.partition(":") if isinstance(namespace, str) else ("", "", "")
        if not sep or kind not in KeySpace.NAMESPACE_KINDS:
            kinds = ", ".join(f"'{k}:ID'" for k in KeySpace.NAMESPACE_KINDS)
            raise InvalidStoreRequest(f"invalid namespace {namespace!r}: use one of {kinds}")
        return f"{kind}:{validate_id(ident, 'namespace id')}"

    @staticmethod
    def record(namespace: str, key: str) -> Key:
        tag = KeySpace.namespace_tag(namespace)
        return Key(tag, KeySpace.RECORD_PREFIX + validate_id(key, "record key"))

    @staticmethod
    def blob(namespace: str, key: str) -> Key:
        tag = KeySpace.namespace_tag(namespace)
        return Key(tag, KeySpace.BLOB_PREFIX + validate_id(key, "blob key"))

    # Per-tenant usage ledger (memory_store/usage.py): one tag per tenant, so its counters
    # change in one atomic step on one Redis Cluster slot.
    USAGE = "usage"

    @staticmethod
    def usage_tag(tenant: str) -> str:
        return f"{KeySpace.USAGE}:{validate_id(tenant, 'tenant id')}"


REDIS_KEY_PREFIX = "longserve"


def redis_key(key_tag: str, kind: str, path: str) -> str:
    """`longserve:{sess:ID}:blob:doc/x` - the hash tag is the part in braces."""
    return f"{REDIS_KEY_PREFIX}:{{{key_tag}}}:{kind}:{path}"
