"""GET /metrics: Prometheus text that parses, with counters that move."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_until_async
from tests.server.conftest import MODEL, asgi_client
from tests.server.fake_engine import FakeEngine


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple], float]:
    response = await client.get("/metrics", headers={"Authorization": ""})
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def test_metrics_move(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    before = await scrape(client)
    assert before[("longserve:prompt_tokens_total", ())] == 0
    assert before[("longserve:memory_tokens", ())] == 123  # read from engine.stats()
    assert ("longserve:num_requests_running", ()) in before
    assert ("longserve:num_requests_waiting", ()) in before
    assert ("longserve:sessions_active", ()) in before
    assert ("longserve:sessions_offloaded", ()) in before
    assert before[("longserve:prefix_cache_hits_total", ())] == 2  # engine.stats() too
    assert before[("longserve:prefix_cache_misses_total", ())] == 0
    assert before[("longserve:prefix_cache_tokens_reused_total", ())] == 4096
    assert before[("longserve:prefix_cache_evictions_total", ())] == 0
    assert before[("longserve:prefix_cache_entries", ())] == 1
    assert before[("longserve:prefix_cache_bytes", ())] == 1 << 20
    assert before[("longserve:prefix_cache_store_hits_total", ())] == 1
    assert before[("longserve:prefix_cache_store_tokens_imported_total", ())] == 2048
    assert before[("longserve:prefix_cache_store_chunks_written_total", ())] == 8
    assert before[("longserve:prefix_cache_store_failures_total", ())] == 0

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a b c"}],
        "temperature": 0,
        "n": 2,
    }
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    body = {**body, "stream": True, "n": 1, "max_tokens": 2}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200

    after = await scrape(client)
    assert after[("longserve:prompt_tokens_total", ())] == 9
    assert after[("longserve:generation_tokens_total", ())] == 8
    assert after[("longserve:request_success_total", (("finished_reason", "stop"),))] == 2
    assert after[("longserve:request_success_total", (("finished_reason", "length"),))] == 1
    assert after[("longserve:time_to_first_token_seconds_count", ())] == 3
    assert after[("longserve:inter_token_latency_seconds_count", ())] == 5
    assert after[("longserve:e2e_request_latency_seconds_count", ())] == 3
    assert after[("longserve:retrieval_seconds_count", (("strategy", "segments"),))] == 3
    assert any(name.startswith("process_") for name, _ in after)


async def test_aborted_and_failed_requests_are_counted(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.fail_after_tokens = 1
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a b c"}]}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 500
    after = await scrape(client)
    assert after[("longserve:request_success_total", (("finished_reason", "error"),))] == 1


async def test_each_app_has_its_own_registry(client: httpx.AsyncClient) -> None:
    from server.app import build_app
    from server.settings import ServerSettings

    other = build_app(ServerSettings(), FakeEngine(MODEL))  # no duplicate-metric error
    assert other.state.serving.metrics.registry is not None


def gateway_samples(text: str) -> dict[str, tuple[str, dict[str, str], float]]:
    """The inference gateway's three vLLM gauges: name -> (type, labels, value)."""
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:"):
            (sample,) = family.samples
            found[family.name] = (family.type, sample.labels, sample.value)
    return found


async def test_inference_gateway_gauges_follow_the_engine(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    async def gauges() -> dict[str, tuple[str, dict[str, str], float]]:
        response = await client.get("/metrics", headers={"Authorization": ""})
        return gateway_samples(response.text)

    idle = await gauges()
    assert set(idle) == {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    }
    for kind, labels, _ in idle.values():
        assert (kind, labels) == ("gauge", {"model_name": MODEL})
    assert idle["vllm:num_requests_running"][2] == 0
    assert idle["vllm:num_requests_waiting"][2] == 0
    # 123 memory tokens held, one tenant (one API key) at the default 4M tokens
    assert idle["vllm:kv_cache_usage_perc"][2] == pytest.approx(123 / 4_000_000)

    engine.gate.clear()  # requests hold before their first token
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a b c"}], "n": 2}
    request = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    await wait_until_async(lambda: len(engine.running) == 2, "two choices never ran")
    engine.memory_tokens = 3_000_000
    busy = await gauges()
    assert busy["vllm:num_requests_running"][2] == 2
    assert busy["vllm:kv_cache_usage_perc"][2] == pytest.approx(0.75)
    engine.gate.set()
    assert (await request).status_code == 200
    assert (await gauges())["vllm:num_requests_running"][2] == 0

    engine.memory_tokens = 9_000_000  # past the budget: reported as full, never above 1
    assert (await gauges())["vllm:kv_cache_usage_perc"][2] == 1.0


async def test_kv_cache_usage_counts_every_tenants_budget(engine: FakeEngine) -> None:
    from server.app import build_app
    from server.settings import ServerSettings

    settings = ServerSettings(api_keys=["k1", "k2"], max_memory_tokens_per_tenant=1000)
    engine.memory_tokens = 500
    async with asgi_client(build_app(settings, engine), api_key="k1") as http:
        response = await http.get("/metrics")
    assert gateway_samples(response.text)["vllm:kv_cache_usage_perc"][2] == 0.25
