"""Ingest from scratch vs rebuild from the memory store, in one run (engine/caches/store.py).

One LocalEngine on the model (default: the embedded SmolLM2-135M) with an embedded store in a
temporary data dir: session A ingests a document (forward every chunk, put its encodings),
session B ingests the same document into a fresh session with the same memory config, which
imports every chunk from the store with zero model forwards (counted with a forward hook).
Printed as JSON lines: seconds of each, their ratio, and stored bytes per token (the chunk
files on disk / tokens; fp16 K/V of every layer plus the header and token ids).

    python -m bench.store_rebuild --tokens 16384 --strategy segments
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.memory_speed import random_text_ids
from engine.client import LocalEngine
from engine.config import EngineConfig
from engine.protocol import MemorySpec
from engine.runner.loader import load_model


async def _ingest(engine: LocalEngine, request_id: str, session_id: str, text: str):
    started = time.perf_counter()
    last = None
    async for progress in engine.ingest(request_id, session_id, text):
        last = progress
    return last, time.perf_counter() - started


def _chunk_bytes(data_dir: Path) -> tuple[int, int]:
    files = [p for p in (data_dir / "memory-store").rglob("chunk.*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


async def run(args: argparse.Namespace, data_dir: Path) -> None:
    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, data_dir=str(data_dir)
    )
    engine = LocalEngine(config, loaded=load_model(config))
    try:
        ids = random_text_ids(engine._device_tokenizer, args.tokens, seed=0)
        text = engine._device_tokenizer.decode(ids)
        spec = MemorySpec(args.strategy, {})
        forwards = [0]

        def count(*_: object) -> None:
            forwards[0] += 1

        handle = engine.loaded.model.register_forward_hook(count)
        await engine.create_session("scratch", spec)
        scratch, scratch_s = await _ingest(engine, "doc-scratch", "scratch", text)
        scratch_forwards, forwards[0] = forwards[0], 0
        await engine.drop_session("scratch")
        await engine.create_session("rebuilt", spec)
        rebuilt, rebuild_s = await _ingest(engine, "doc-rebuilt", "rebuilt", text)
        rebuild_forwards = forwards[0]
        handle.remove()
        chunks, nbytes = _chunk_bytes(data_dir)
        tokens = scratch.tokens_total
        common = {
            "model": engine.model.id,
            "device": str(engine.loaded.device),
            "dtype": str(engine.loaded.model.dtype),
            "strategy": args.strategy,
            "tokens": tokens,
        }
        print(
            json.dumps(
                {
                    **common,
                    "phase": "scratch",
                    "seconds": round(scratch_s, 3),
                    "forwards": scratch_forwards,
                    "tokens_from_store": scratch.tokens_from_store,
                }
            )
        )
        print(
            json.dumps(
                {
                    **common,
                    "phase": "rebuild",
                    "seconds": round(rebuild_s, 3),
                    "forwards": rebuild_forwards,
                    "tokens_from_store": rebuilt.tokens_from_store,
                }
            )
        )
        print(
            json.dumps(
                {
                    **common,
                    "phase": "summary",
                    "speedup": round(scratch_s / rebuild_s, 2),
                    "stored_chunks": chunks,
                    "store_bytes": nbytes,
                    "store_bytes_per_token": round(nbytes / tokens, 1),
                }
            )
        )
        sys.stdout.flush()
    finally:
        await engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--strategy", default="segments")
    parser.add_argument("--data-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args(argv)
    if args.data_dir is not None:
        asyncio.run(run(args, Path(args.data_dir)))
        return
    with tempfile.TemporaryDirectory(prefix="longserve-store-bench-") as tmp:
        asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    main()
