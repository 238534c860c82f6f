"""`longserve memory-store`: argument wiring for server/cli.py, which owns the `longserve` command.

    longserve memory-store --port 8001 (--redis-url redis://host:6379/0 | --data-dir DIR)
    longserve memory-store --redis-url redis+cluster://:PASSWORD@node1:6379,node2:6379

Flags override LONGSERVE_MEMORY_STORE_* environment variables; unset flags leave them alone.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from pydantic import ValidationError

from memory_store.settings import MemoryStoreSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default 8001)")
    backend = parser.add_mutually_exclusive_group()
    backend.add_argument(
        "--redis-url",
        default=None,
        help="the Redis backend: redis://[:password@]host:port/db (also rediss://, unix://), or "
        "a Redis Cluster: redis+cluster://[:password@]host:port[,host:port...] (rediss+cluster:// "
        "for TLS); on a cluster each write waits for a replica "
        "(LONGSERVE_MEMORY_STORE_REDIS_MIN_REPLICAS_ACK)",
    )
    backend.add_argument("--data-dir", default=None, help="directory of the embedded backend")
    parser.add_argument("--max-blob-bytes", type=int, default=None, help="largest request body")
    parser.add_argument("--log-level", default=None, help="debug, info, warning, error")


def settings_from_args(args: argparse.Namespace) -> MemoryStoreSettings:
    overrides: dict[str, Any] = {}
    for name in ("host", "port", "redis_url", "data_dir", "max_blob_bytes", "log_level"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    # A flag picks the backend: drop the other one if the environment set it.
    if "redis_url" in overrides:
        overrides.setdefault("data_dir", None)
    if "data_dir" in overrides:
        overrides.setdefault("redis_url", None)
    return MemoryStoreSettings(**overrides)


def run(args: argparse.Namespace) -> int:
    from memory_store.app import serve

    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        messages = "; ".join(str(e.get("msg", "invalid")) for e in exc.errors())
        print(f"longserve memory-store: invalid configuration: {messages}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper())
    serve(settings)
    return 0
