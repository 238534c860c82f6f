"""The fake engine the server tests run against keeps to the engine contract, as the real one
does (tests/engine/test_client.py), so a server test that passes on it holds for LocalEngine."""

from __future__ import annotations

from engine.protocol import EngineClient
from tests.helpers import protocol_mismatches
from tests.server.fake_engine import FakeEngine


def test_fake_engine_implements_engine_client() -> None:
    assert isinstance(FakeEngine(), EngineClient)
    assert protocol_mismatches(FakeEngine, EngineClient) == []


def test_the_check_sees_a_drifted_fake() -> None:
    class Drifted(FakeEngine):
        def abort(self, request_id: str, reason: str = "") -> None:  # type: ignore[override]
            pass

    assert protocol_mismatches(Drifted, EngineClient) == [
        "abort: async is False, not as declared",
        "abort(self, request_id: str, reason: str = '') -> None is not "
        "abort(self, request_id: str) -> None",
    ]
