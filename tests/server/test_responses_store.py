"""Stored responses live in the memory store (fake engine, real embedded store): a
`previous_response_id` made on one replica continues on another, a deletion through one is
seen by the other, and another tenant's id is unknown."""

from __future__ import annotations

from pathlib import Path

from tests.server.fake_engine import last_text
from tests.server.test_session_records import MODEL, OTHER_KEY, embedded_client, replica
from tests.server.test_sessions import error_of


async def test_a_response_continues_on_another_replica(tmp_path: Path) -> None:
    async with (
        replica(embedded_client(tmp_path / "s"), {}) as a,
        replica(embedded_client(tmp_path / "s"), {}) as b,
    ):
        first = await a.http.post(
            "/v1/responses", json={"model": MODEL, "input": "remember the word zebra"}
        )
        assert first.status_code == 200, first.text
        first_id = first.json()["id"]
        second = await b.http.post(
            "/v1/responses",
            json={"model": MODEL, "input": "which word?", "previous_response_id": first_id},
        )
        assert second.status_code == 200, second.text
        sent = b.engine.calls[-1].prompt
        assert "remember the word zebra" in str(sent)  # B read the first turn from the store
        assert last_text(sent) == "which word?"
        assert (await b.http.get(f"/v1/responses/{first_id}")).json()["id"] == first_id

        other = await b.http.get(
            f"/v1/responses/{first_id}", headers={"Authorization": f"Bearer {OTHER_KEY}"}
        )
        error_of(other, 404, "response_not_found")

        assert (await b.http.delete(f"/v1/responses/{first_id}")).status_code == 200
        error_of(await a.http.get(f"/v1/responses/{first_id}"), 404, "response_not_found")


async def test_store_false_keeps_nothing(tmp_path: Path) -> None:
    async with replica(embedded_client(tmp_path / "s"), {}) as a:
        made = await a.http.post(
            "/v1/responses", json={"model": MODEL, "input": "hello", "store": False}
        )
        assert made.status_code == 200
        error_of(await a.http.get(f"/v1/responses/{made.json()['id']}"), 404, "response_not_found")
