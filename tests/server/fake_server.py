"""`python -m tests.server.fake_server --port N --api-key K --model M`: the app around the fake engine, served by the
same drain-aware server the CLI uses (server.drain.serve), for tests that need a real process
(signals, exit status). The fake engine waits `--token-delay` seconds before each token."""

from __future__ import annotations

import argparse
import logging
import sys

from server.app import build_app
from server.drain import serve
from server.settings import ServerSettings
from tests.server.fake_engine import FakeEngine


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--token-delay", type=float, default=0.05)
    parser.add_argument("--drain-timeout", type=float, default=10.0)
    args = parser.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = FakeEngine(args.model, token_delay=args.token_delay)
    settings = ServerSettings(
        api_keys=[args.api_key], port=args.port, drain_timeout_seconds=args.drain_timeout
    )
    app = build_app(settings, engine)
    started = serve(app, app.state.drain, settings.host, settings.port, "info")
    logging.getLogger(__name__).info("engine shut down: %s", engine.shutdown_called)
    return 0 if started else 3


if __name__ == "__main__":
    sys.exit(main())
