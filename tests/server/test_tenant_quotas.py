"""Per-tenant bounds on what the Responses API stores (fake engine, real embedded store):
metadata as OpenAI bounds it, stored responses bounded in bytes per tenant, counted in the
memory store's usage ledger so that every replica sees the same figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.server.test_session_records import MODEL, embedded_client, replica


@pytest.mark.parametrize(
    "metadata",
    [
        {"k": "v" * 2 * 1024 * 1024},  # 2 MB in one value
        {f"k{i}": "v" for i in range(17)},  # 17 pairs
        {"k" * 65: "v"},  # a 65-character key
        {"k": "v" * 513},  # a 513-character value
        {"k": 5},  # values are strings only
    ],
)
async def test_response_metadata_is_bounded_as_openai_bounds_it(
    tmp_path: Path, metadata: dict[str, Any]
) -> None:
    async with replica(embedded_client(tmp_path / "s"), {}, max_body_bytes=4 * 1024 * 1024) as a:
        made = await a.http.post(
            "/v1/responses", json={"model": MODEL, "input": "hi", "metadata": metadata}
        )
        assert made.status_code == 400, made.text[:500]
        error = made.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"].startswith("metadata")
        assert "metadata" in error["message"] and len(error["message"]) < 200
        assert a.engine.calls == []  # nothing ran, nothing was stored
        assert not list((tmp_path / "s").rglob("*.rec"))


async def test_response_metadata_within_the_bounds_is_kept(tmp_path: Path) -> None:
    metadata = {f"k{i:02d}" + "x" * 60: "v" * 512 for i in range(16)}
    async with replica(embedded_client(tmp_path / "s"), {}) as a:
        made = await a.http.post(
            "/v1/responses", json={"model": MODEL, "input": "hi", "metadata": metadata}
        )
        assert made.status_code == 200, made.text
        got = await a.http.get(f"/v1/responses/{made.json()['id']}")
        assert got.json()["metadata"] == metadata
