"""The `longserve` console script. Subcommands only build settings and start things.

The engine (torch, transformers) is imported lazily inside `serve`, so `longserve --help` and
the other subcommands stay light.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from server.settings import ServerSettings

if TYPE_CHECKING:
    from memory_store.client import MemoryStoreClient

EXIT_BAD_CONFIG = 2
EMBEDDED_STORE = "memory-store"  # under --data-dir; engine/caches/store.py uses the same directory
EXIT_STARTUP_FAILURE = 3  # uvicorn's own code for a failed start-up


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------------------------------------
# serve
# ---------------------------------------------------------------------------------------------


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default 8000)")
    parser.add_argument("--model", help="local model directory or hub id (default: SmolLM2)")
    parser.add_argument("--served-model-name", help="the model id clients send")
    parser.add_argument("--device", help="auto, cpu, cuda, cuda:1 ...")
    parser.add_argument("--dtype", help="auto, float32, bfloat16, float16")
    parser.add_argument(
        "--linear-dtype",
        help="the linear layers' weight precision: auto (a GGUF on CPU: each linear as the file "
        "holds it, Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0; else the model's), float32, bfloat16, "
        "int4 (CPU)",
    )
    parser.add_argument(
        "--kv-dtype",
        help="plain requests' KV caches: auto (float16 under quantized linears, else model), "
        "model, float16",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        metavar="KEY",
        help="an accepted API key (repeatable); also LONGSERVE_API_KEYS=k1,k2",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="the window of one forward; longer prompts go through memory (default: the model's)",
    )
    parser.add_argument("--max-waiting-requests", type=int)
    parser.add_argument("--max-running-requests", type=int)
    parser.add_argument("--max-waiting-requests-per-tenant", type=int)
    parser.add_argument("--max-running-requests-per-tenant", type=int)
    parser.add_argument(
        "--memory-store",
        dest="memory_store_url",
        metavar="URL",
        help="memory service URL (`longserve memory-store`); default: an embedded store in "
        "--data-dir",
    )
    parser.add_argument("--data-dir", help="where the embedded memory store persists")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads for the model (default: one per core; N replicas on one machine: "
        "cores / N each)",
    )
    parser.add_argument(
        "--adapter",
        action="append",
        dest="adapters",
        metavar="[NAME=]PATH",
        help="an answer adapter file (longserve adapt) served as the model <id>:NAME "
        "(repeatable; the shipped ones are always served)",
    )
    parser.add_argument(
        "--projection-dir",
        help="neurocache projections clients name by id: <dir>/<id>.pt (default: none)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """CLI flags override LONGSERVE_* environment variables, which override defaults."""
    fields = (
        "host",
        "port",
        "model",
        "served_model_name",
        "device",
        "dtype",
        "linear_dtype",
        "kv_dtype",
        "api_keys",
        "max_model_len",
        "max_waiting_requests",
        "max_running_requests",
        "max_waiting_requests_per_tenant",
        "max_running_requests_per_tenant",
        "memory_store_url",
        "data_dir",
        "projection_dir",
        "threads",
        "adapters",
    )
    overrides: dict[str, Any] = {
        name: getattr(args, name) for name in fields if getattr(args, name, None) is not None
    }
    return ServerSettings(**overrides)


def tenant_shares(settings: ServerSettings) -> dict[str, int | None]:
    """Each API key's share of the engine's queue; without keys every request is the one
    tenant "default", which gets the whole queue (docs/decisions/060)."""
    waiting = settings.max_waiting_requests_per_tenant
    running = settings.max_running_requests_per_tenant
    if not settings.api_keys:
        waiting = waiting or settings.max_waiting_requests
        running = running or settings.max_running_requests
    return {
        "max_waiting_requests_per_tenant": waiting,
        "max_running_requests_per_tenant": running,
    }


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level != "debug":  # one line per memory store call drowns the server's own
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        messages = "; ".join(_error_text(e) for e in exc.errors())
        print(f"longserve: invalid configuration: {messages}", file=sys.stderr)
        return EXIT_BAD_CONFIG

    url = settings.memory_store_url
    if url is not None and not url.startswith(("http://", "https://")):
        print(
            f"longserve: invalid configuration: memory_store_url: {url!r} is not the http(s) URL "
            "of a memory service (run `longserve memory-store --redis-url ...` for Redis)",
            file=sys.stderr,
        )
        return EXIT_BAD_CONFIG

    from engine.config import EngineConfig
    from engine.start import start_engine
    from server.app import build_app
    from server.drain import serve

    engine_fields: dict[str, Any] = {
        "model": settings.model,
        "served_model_name": settings.served_model_name,
        "device": settings.device,
        "dtype": settings.dtype,
        "linear_dtype": settings.linear_dtype,
        "kv_dtype": settings.kv_dtype,
        "lean_decode": settings.lean_decode,
        "adapters": tuple(settings.adapters),
        "batch_invariant": settings.batch_invariant,
        "max_model_len": settings.max_model_len,
        "max_waiting_requests": settings.max_waiting_requests,
        "max_running_requests": settings.max_running_requests,
        **tenant_shares(settings),
        "session_offload_after_s": settings.session_offload_after_seconds,
        "memory_disk_dir": settings.memory_disk_dir,
        "memory_disk_bytes": settings.memory_disk_bytes,
        "session_ram_bytes": settings.session_ram_bytes,
        "memory_ram_bytes": settings.memory_ram_bytes,
        "collection_max_chunks": settings.collection_max_chunks,
        "collection_top_k": settings.collection_top_k,
        "text_prior": settings.text_prior,
        "prefix_cache_bytes": settings.prefix_cache_bytes,
        "kv_prefix_cache_bytes": settings.kv_prefix_cache_bytes,
        "trim_heap": settings.trim_heap,
        "prefix_cache_store": settings.prefix_cache_store,
        "prefix_store_max_entries_per_tenant": settings.max_prefix_store_entries_per_tenant,
        "max_turn_encoding_bytes": settings.max_turn_encoding_bytes,
        "decode_share": settings.decode_share,
        "projection_dir": settings.projection_dir,
        "max_projection_bytes": settings.max_projection_bytes,
        "preprocess_threads": settings.preprocess_threads,
        "threads": settings.threads,
        "preprocess_threads_per_tenant": settings.preprocess_threads_per_tenant,
        "preprocess_nice": settings.background_nice,
        "max_preprocess_waiting_per_tenant": settings.max_preprocess_waiting_per_tenant,
        # One store for the engine's encodings and the server's session records: the memory
        # service, or the embedded store under --data-dir.
        "memory_store_url": settings.memory_store_url,
        "data_dir": None if settings.memory_store_url else settings.data_dir,
        "memory_store_token": (
            settings.memory_store_token.get_secret_value() if settings.memory_store_token else None
        ),
    }
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    config = EngineConfig(**{k: v for k, v in engine_fields.items() if k in known})
    logging.getLogger(__name__).info("loading the engine (%s)", settings.model or "default")
    store = memory_store_client(settings)
    # httpx.AsyncClient is bound to one event loop and the engine calls its store from its own:
    # only the in-process (embedded) client is shared; over HTTP the engine builds its own.
    engine = start_engine(config, store=None if settings.memory_store_url else store)
    app = build_app(settings, engine, store=store)
    started = serve(app, app.state.drain, settings.host, settings.port, args.log_level)
    return 0 if started else EXIT_STARTUP_FAILURE


def memory_store_client(settings: ServerSettings) -> MemoryStoreClient:
    """The process's client (session records, and the engine's encodings when embedded): the
    memory service at --memory-store, else the embedded store in DATA_DIR/memory-store."""
    from memory_store.client import embedded_client, http_client

    if settings.memory_store_url:
        token = settings.memory_store_token
        return http_client(
            settings.memory_store_url,
            token=token.get_secret_value() if token is not None else None,
        )
    return embedded_client(Path(settings.data_dir) / EMBEDDED_STORE)


def _error_text(error: Any) -> str:
    message = str(error.get("msg", "invalid"))
    loc = ".".join(str(part) for part in error.get("loc", ()))
    return f"{loc}: {message}" if loc else message.removeprefix("Value error, ")


# ---------------------------------------------------------------------------------------------
# The subcommand table. Other parts register theirs here, each as a Subcommand whose
# add_arguments/run live next to the code they start, imported lazily so that one subcommand
# never loads another's dependencies.
# ---------------------------------------------------------------------------------------------


def _lazy(module: str, attribute: str) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(module), attribute)(*args)

    return call


BENCHMARKS = (
    "passkey",
    "memory_speed",
    "serving_overhead",
    "load",
    "larimar_passkey",
    "store_rebuild",
    "recall",
    "prefix",
    "memory_load",
    "structured",
    "json_recall",
    "peers",
    "soak",
    "decode_floor",
    "decode_agreement",
    "gguf_products",
    "memory_batch",
    "int8_memory",
    "long_docs",
    "disk_tier",
    "million",
    "concurrency",
    "store_profile",
    "gguf_types",
    "question_rss",
)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=BENCHMARKS, help="which benchmark (bench/<name>.py)")
    parser.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="the benchmark's own arguments (longserve bench NAME --help)",
    )


def run_bench(args: argparse.Namespace) -> int:
    """Run bench/<name>.py's main with the rest of the command line: the same program as
    `python -m bench.<name>`, reachable wherever `longserve` is installed."""
    importlib.import_module(f"bench.{args.name}").main(list(args.args))
    return 0


SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand("run the OpenAI-compatible HTTP server", add_serve_arguments, run_serve),
    "memory-store": Subcommand(
        "run the memory service (encoder-output store, Larimar memory)",
        _lazy("memory_store.cli", "add_arguments"),
        _lazy("memory_store.cli", "run"),
    ),
    "ingest": Subcommand(
        "pre-encode documents offline into a memory-store collection",
        _lazy("engine.caches.ingest_cli", "add_arguments"),
        _lazy("engine.caches.ingest_cli", "run"),
    ),
    "adapt": Subcommand(
        "train an answer adapter on synthetic retrieval tasks (bench/adapt.py)",
        _lazy("bench.adapt", "add_arguments"),
        _lazy("bench.adapt", "run"),
    ),
    "bench": Subcommand(
        "run a benchmark from bench/ (one JSON line per measurement)",
        add_bench_arguments,
        run_bench,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longserve",
        description="OpenAI-compatible server for documents longer than the model's window.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, subcommand in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=subcommand.help, description=subcommand.help)
        subcommand.add_arguments(sub)
        sub.set_defaults(run=subcommand.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
