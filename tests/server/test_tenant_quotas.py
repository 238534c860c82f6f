"""Per-tenant bounds on what the Responses API stores (fake engine, real embedded store):
metadata as OpenAI bounds it, stored responses bounded in bytes per tenant, counted in the
memory store's usage ledger so that every replica sees the same figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.server.test_session_records import MODEL, OTHER_KEY, embedded_client, replica
from tests.server.test_sessions import error_of


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


async def test_stored_response_bytes_are_bounded_per_tenant_across_replicas(
    tmp_path: Path,
) -> None:
    """Two replicas over one store: what A stored counts on B; past the bound store=true is a
    429 naming the limit, store=false still answers, another tenant is untouched, and a
    deletion gives the bytes back."""
    # One response of `big` stores about 9.5 KB: the input, the (echoed) answer, the output.
    limits = {"max_stored_response_bytes_per_tenant": 12_000}
    big = "word " * 600
    async with (
        replica(embedded_client(tmp_path / "s"), {}, **limits) as a,
        replica(embedded_client(tmp_path / "s"), {}, **limits) as b,
    ):
        first = await a.http.post("/v1/responses", json={"model": MODEL, "input": big})
        assert first.status_code == 200, first.text
        # Its input alone (3 KB) still fits on B, so B answers, then cannot store it: 429.
        second = await b.http.post("/v1/responses", json={"model": MODEL, "input": big})
        error = error_of(second, 429, "stored_response_limit")
        assert "max_stored_response_bytes_per_tenant" in error["message"]
        assert 9_000 < await b.metric_labeled("longserve:tenant_stored_bytes") < 12_000
        error_of(await b.http.get(f"/v1/responses/{second.json().get('id', 'resp_x')}"), 404,
                 "response_not_found")  # fmt: skip
        # An input that cannot fit is refused before anything runs.
        calls = len(b.engine.calls)
        third = await b.http.post("/v1/responses", json={"model": MODEL, "input": big * 2})
        error_of(third, 429, "stored_response_limit")
        assert len(b.engine.calls) == calls

        unstored = await b.http.post(
            "/v1/responses", json={"model": MODEL, "input": big, "store": False}
        )
        assert unstored.status_code == 200, unstored.text
        other = await b.http.post(
            "/v1/responses",
            json={"model": MODEL, "input": big},
            headers={"Authorization": f"Bearer {OTHER_KEY}"},
        )
        assert other.status_code == 200, other.text

        assert (await b.http.delete(f"/v1/responses/{first.json()['id']}")).status_code == 200
        again = await a.http.post("/v1/responses", json={"model": MODEL, "input": big})
        assert again.status_code == 200, again.text
