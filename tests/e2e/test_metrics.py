"""Every metric of the architecture appears in /metrics after one chat and one ingest, and moves."""

from __future__ import annotations

import shutil
import subprocess

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_until

from .conftest import API_KEY, upload_and_wait

pytestmark = pytest.mark.real_model

EXPECTED = {
    # name as exposed (sample name for counters), kind
    "longserve:num_requests_running": "gauge",
    "longserve:num_requests_waiting": "gauge",
    "longserve:time_to_first_token_seconds": "histogram",
    "longserve:inter_token_latency_seconds": "histogram",
    "longserve:e2e_request_latency_seconds": "histogram",
    "longserve:prompt_tokens": "counter",
    "longserve:generation_tokens": "counter",
    "longserve:request_success": "counter",
    "longserve:ingest_tokens": "counter",
    "longserve:ingest_seconds": "histogram",
    "longserve:retrieval_seconds": "histogram",
    "longserve:memory_tokens": "gauge",
    "longserve:sessions_active": "gauge",
    "longserve:sessions_offloaded": "gauge",
    "longserve:sessions_on_disk": "gauge",
    "longserve:memory_disk_bytes": "gauge",
    "longserve:prefix_cache_hits": "counter",
    "longserve:prefix_cache_misses": "counter",
    "longserve:prefix_cache_tokens_reused": "counter",
    "longserve:prefix_cache_evictions": "counter",
    "longserve:prefix_cache_entries": "gauge",
    "longserve:prefix_cache_bytes": "gauge",
    "longserve:grammars_compiled": "counter",
    "longserve:grammar_cache_hits": "counter",
    "longserve:grammar_compile_seconds": "counter",
    "longserve:memory_store_requests": "counter",
    "longserve:memory_store_request_seconds": "histogram",
    # what the Gateway API Inference Extension's endpoint picker reads, under vLLM's names
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
}

DOCUMENT = (
    " ".join(
        f"Paragraph {i}: the warehouse inventory lists crates of apples, pears and plums."
        for i in range(40)
    )
    + " The night guard of the warehouse is named Oswald."
)


def families(server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(server.metrics())}


def value(fams: dict, sample_name: str, **labels: str) -> float:
    return sum(
        s.value
        for f in fams.values()
        for s in f.samples
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_every_metric_appears_and_moves(server):
    client = openai.OpenAI(base_url=server.api_base, api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    before = families(server)

    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in reply if c.usage is not None][0]

    session, _ = upload_and_wait(server.api_base, "inventory.txt", DOCUMENT, timeout_s=300)
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Who is the night guard?"}],
        max_tokens=8,
        temperature=0,
        extra_body={"session_id": session["id"]},
    )

    # A session request appends its last token to memory just after the final delta is sent.
    wait_until(
        lambda: value(families(server), "longserve:num_requests_running") == 0,
        "a finished request is still counted as running",
        timeout_s=30,
        interval_s=0.2,
    )
    after = families(server)
    for name, kind in EXPECTED.items():
        assert name in after, f"{name} missing from /metrics"
        assert after[name].type == kind, (name, after[name].type)

    def moved(sample: str, **labels: str) -> float:
        return value(after, sample, **labels) - value(before, sample, **labels)

    assert moved("longserve:prompt_tokens_total") >= usage.prompt_tokens
    assert moved("longserve:generation_tokens_total") >= usage.completion_tokens
    assert moved("longserve:request_success_total") >= 2
    assert moved("longserve:time_to_first_token_seconds_count") >= 2
    assert moved("longserve:e2e_request_latency_seconds_count") >= 2
    assert moved("longserve:inter_token_latency_seconds_count") >= usage.completion_tokens - 1
    assert moved("longserve:ingest_tokens_total") > 100
    assert moved("longserve:ingest_seconds_count") == 1
    assert moved("longserve:retrieval_seconds_count") >= 1
    assert moved("longserve:memory_store_requests_total") >= 1
    assert value(after, "longserve:num_requests_running") == 0
    assert value(after, "longserve:sessions_active") >= 1
    assert value(after, "longserve:memory_tokens") > 100
    # the session's memory fills the cache the endpoint picker sees: its tokens over the one
    # tenant's (one API key's) default budget of 4M memory tokens
    assert value(before, "vllm:kv_cache_usage_perc") < value(after, "vllm:kv_cache_usage_perc")
    assert value(after, "vllm:kv_cache_usage_perc", model_name=model) == pytest.approx(
        value(after, "longserve:memory_tokens") / 4_000_000
    )
    assert value(after, "vllm:num_requests_running", model_name=model) == 0


def test_promtool_finds_nothing_but_the_colon_convention(server):
    """promtool's lint flags ':' in metric names, which vLLM-style names (and the architecture's
    `longserve:` prefix) use on purpose; every other lint must be clean."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=server.metrics(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    findings = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    other = [line for line in findings if "should not contain ':'" not in line]
    assert other == [], other
