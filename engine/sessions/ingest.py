"""Reading a document into a session's memory, chunk by chunk, on the device thread: straight
from its tokens, or through the memory store's chunks (engine/caches/store.py), which a replica
that has read the same document before can import instead of reading."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import torch

from engine.caches.store import StoreBridge
from engine.caches.store import ingest_steps as store_ingest_steps
from engine.config import EngineConfig
from engine.protocol import IngestProgress
from engine.runner.chat_template import encode_document
from engine.sessions.conversation import Conversation, check_memory_cap
from engine.sessions.tiers import check_disk_room


def read_document_steps(
    session: Conversation,
    text: str,
    tokenizer: Any,
    config: EngineConfig,
    store: StoreBridge | None,
    model_fingerprint: str,
    *,
    session_id: str,
    doc_id: str,
) -> Generator[IngestProgress | None, None, None]:
    """Progress after each chunk read; the last says done, once the document is whole in memory
    and later turns continue after it."""
    started = time.perf_counter()
    ids = encode_document(tokenizer, text, session.rendered)
    check_memory_cap(session.memory.num_tokens + len(ids), config.max_memory_tokens)
    check_disk_room(session.memory, len(ids), config.session_ram_bytes)
    yield IngestProgress(0, len(ids), time.perf_counter() - started, done=not ids)
    session.memory.reserve(len(ids))  # its blocks' room at once, not by doubling
    if store is not None and ids:
        yield from store_ingest_steps(
            store,
            model_fingerprint,
            session.memory,
            ids,
            session_id=session_id,
            doc_id=doc_id,
            decode=lambda piece: str(tokenizer.decode(piece)),
            started=started,
            on_read=lambda: session.read_document(("user", text)),
        )
        return
    chunk = config.prefill_chunk_tokens
    doc = torch.tensor(ids, dtype=torch.long)  # (T,)
    for start in range(0, len(ids), chunk):
        with torch.inference_mode():
            session.memory.append(doc[start : start + chunk], document=True)
        done = min(start + chunk, len(ids))
        if done == len(ids):
            session.read_document(("user", text))
        yield IngestProgress(done, len(ids), time.perf_counter() - started, done=done == len(ids))
