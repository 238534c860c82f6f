"""`longserve ingest`: pre-encode documents offline into a memory-store collection.

    longserve ingest --collection manuals [--data-dir DIR | --memory-store URL] FILE...

Each file is read into a fresh session of a LocalEngine that writes through the store
(engine/caches/store.py), so its chunks' encodings are stored under the model + memory-config
fingerprint, chained from an empty session; then the chunks are attached to the collection with
their `EmbD(c)` (memory_store.embedder), which `select_chunks` ranks against `EmbQ(x)`. A session
that loads them must use the same model and memory config (the fingerprint says so). The
argument wiring (`add_arguments` / `run`) is for server/cli.py's subcommand table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="UTF-8 text files to encode")
    parser.add_argument("--collection", required=True, help="collection to attach the chunks to")
    store = parser.add_mutually_exclusive_group(required=True)
    store.add_argument(
        "--memory-store",
        dest="memory_store_url",
        metavar="URL",
        help="memory service URL (`longserve memory-store`)",
    )
    store.add_argument("--data-dir", help="embedded memory store under DATA_DIR/memory-store")
    parser.add_argument("--model", help="local model directory or hub id (default: SmolLM2)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--strategy", default="segments", help="memory strategy sessions use")
    parser.add_argument(
        "--memory",
        default="{}",
        metavar="JSON",
        help="memory knobs sessions use, e.g. '{\"k\": 4}' (default: none)",
    )


async def ingest_files(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Encode every file; one summary dict per file."""
    from engine.caches.store import document_id
    from engine.client import LocalEngine
    from engine.config import EngineConfig
    from engine.protocol import MemorySpec
    from memory_store.client import default_embedder

    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        memory_store_url=args.memory_store_url,
        data_dir=args.data_dir,
        # The memory service's shared secret, as `longserve serve` reads it.
        memory_store_token=os.environ.get("LONGSERVE_MEMORY_STORE_TOKEN") or None,
    )
    spec = MemorySpec(args.strategy, json.loads(args.memory))
    engine = LocalEngine(config)
    bridge = engine._store
    assert bridge is not None  # one of --memory-store / --data-dir is required
    results = []
    try:
        for path in args.files:
            text = Path(path).read_text(encoding="utf-8")
            session_id = f"ingest-{uuid.uuid4().hex[:12]}"
            request_id = document_id(Path(path).name) + "-" + uuid.uuid4().hex[:8]
            await engine.create_session(session_id, spec)
            last = None
            async for progress in engine.ingest(request_id, session_id, text):
                last = progress
            await engine.drop_session(session_id)
            if last is None or not last.tokens_total:
                results.append({"file": path, "tokens": 0, "chunks": 0})
                continue
            manifest = bridge.get_manifest(session_id, document_id(request_id))
            # The chunk texts come back with their encodings (an offline tool can afford it).
            texts = [bridge.get_chunk(manifest.fingerprint, h).text for h in manifest.chunk_hashes]
            bridge.add_to_collection(
                args.collection,
                manifest.fingerprint,
                manifest.chunk_hashes,
                default_embedder().embed(texts),
            )
            bridge.delete_session(session_id)  # the throwaway session's manifest; chunks stay
            results.append(
                {
                    "file": path,
                    "tokens": last.tokens_total,
                    "tokens_from_store": last.tokens_from_store,
                    "chunks": len(manifest.chunk_hashes),
                    "fingerprint": manifest.fingerprint,
                }
            )
    finally:
        await engine.shutdown()
    return results


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        json.loads(args.memory)
    except ValueError as e:
        print(f"longserve ingest: --memory is not JSON: {e}", file=sys.stderr)
        return 2
    for result in asyncio.run(ingest_files(args)):
        print(json.dumps({"collection": args.collection, **result}))
    return 0
