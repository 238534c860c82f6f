"""Graceful shutdown: on SIGTERM (or Ctrl-C) the server drains before it stops.

Uvicorn, on a signal, closes its listening socket at once, so a load balancer still sending
traffic gets connection errors. Draining instead means:

1. The first SIGTERM/SIGINT only marks the server as draining (DrainingServer.handle_exit).
   The socket stays open. /ready answers 503 so load balancers stop routing here; every other
   new request (but /health and /metrics) gets an OpenAI-shaped 503 `server_shutting_down`
   with Retry-After and `Connection: close` (DrainGate).
2. Requests already in flight, streams included, run on. Once none is left, or once
   `drain_timeout_seconds` has passed, uvicorn's own shutdown starts: it closes the socket,
   cuts what is still running after SHUTDOWN_GRACE_SECONDS, runs the lifespan shutdown (the
   engine stops) and the process exits with status 0.
3. A second signal skips the rest of the drain: uvicorn's usual immediate shutdown.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import error_response, server_shutting_down
from server.limits import MAX_HEAD_BYTES

logger = logging.getLogger(__name__)

# After the drain: how long uvicorn lets the requests still running (the drain timed out) end
# before it cancels them. SSE streams are cut by sse-starlette within about a second.
SHUTDOWN_GRACE_SECONDS = 3

# Answered while draining, and not counted as in flight: liveness and metrics stay up to the
# end, and /ready reports the drain itself.
UNGATED_PATHS = frozenset({"/health", "/ready", "/metrics"})


@dataclass
class DrainState:
    """Shared by the app (which counts requests) and the server (which decides when to stop).
    Everything touches it from the event loop's thread; the signal handler only sets flags."""

    timeout_seconds: float
    draining: bool = False
    in_flight: int = 0
    deadline: float = float("inf")

    def start(self) -> None:
        if not self.draining:
            self.draining = True
            self.deadline = time.monotonic() + self.timeout_seconds


class DrainGate:
    """ASGI middleware: counts HTTP requests in flight; refuses new ones while draining."""

    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNGATED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            await error_response(server_shutting_down())(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal starts a drain instead of the shutdown."""

    def __init__(self, config: uvicorn.Config, drain: DrainState) -> None:
        super().__init__(config)
        self.drain = drain
        self._drain_announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler: set flags only (no logging, no awaiting).
        if self.drain.draining:
            super().handle_exit(sig, frame)  # the second signal: stop now
        else:
            self.drain.start()

    async def on_tick(self, counter: int) -> bool:
        drain = self.drain
        if drain.draining and not self.should_exit:
            if not self._drain_announced:
                self._drain_announced = True
                logger.info(
                    "draining: %d request(s) in flight, waiting up to %gs",
                    drain.in_flight,
                    drain.timeout_seconds,
                )
            if drain.in_flight == 0:
                logger.info("drained; shutting down")
                self.should_exit = True
            elif time.monotonic() >= drain.deadline:
                logger.warning(
                    "drain timeout (%gs) passed with %d request(s) in flight; cutting them",
                    drain.timeout_seconds,
                    drain.in_flight,
                )
                self.should_exit = True
        return await super().on_tick(counter)


def uvicorn_config(app: ASGIApp, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
        # h11 refuses a head that waits incomplete past this (400); one that arrives complete
        # is checked by the app against the same number (431, server/limits.py).
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
    )


def serve(app: ASGIApp, drain: DrainState, host: str, port: int, log_level: str = "info") -> bool:
    """Serve `app` until a signal and a drain end it. False when the server never started."""
    server = DrainingServer(uvicorn_config(app, host, port, log_level), drain)
    server.run()
    return server.started
