"""The production compose stack, built and started here, then broken and healed: proxy, two
server replicas, the memory service, Redis with AOF and Prometheus, in real containers. Every
request goes through the proxy's published port, as a user's would. The tests run in order on
one stack; each says what a user or operator would do and what they must see."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.test_replicas import DOCUMENT, KEY, QUESTION
from tests.stack import images
from tests.stack.figures import FIGURES
from tests.stack.stack import API_KEY, Stack

pytestmark = [pytest.mark.stack, pytest.mark.timeout(2400)]

SERVICES = ("proxy", "server", "memory-store", "redis", "prometheus")
REPLICAS = {"server": 2}
TURNS = ["What is the pass key?", "Say it again, please.", "What colour is the sky?"]


@pytest.fixture(scope="module")
def stack(built: dict[str, images.Built], log_dir: Path) -> Iterator[Stack]:
    stack = Stack("longserve-stack-test", log_dir)
    stack.down(volumes=True)  # what an earlier, interrupted run left
    try:
        FIGURES["time_to_healthy_seconds"] = round(stack.up(*SERVICES, scale=REPLICAS), 1)
        yield stack
    finally:
        stack.save_logs()
        stack.down(volumes=True)


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    """What one test leaves for the next: the session, its conversation, its replica."""
    return {}


def api(stack: Stack) -> httpx.Client:
    return httpx.Client(
        base_url=stack.api_base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300
    )


def client(stack: Stack, session_id: str | None = None, retries: int = 0) -> openai.OpenAI:
    headers = {"X-Longserve-Session": session_id} if session_id else {}
    return openai.OpenAI(
        base_url=stack.api_base, api_key=API_KEY, max_retries=retries, timeout=300,
        default_headers=headers,
    )  # fmt: skip


def chat(stack: Stack, session_id: str, messages: list[dict], retries: int = 0) -> str:
    with client(stack, session_id, retries) as c:
        model = c.models.list().data[0].id
        completion = c.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0,  # type: ignore[arg-type]
            extra_body={"session_id": session_id},
        )  # fmt: skip
    return completion.choices[0].message.content or ""


def session_object(stack: Stack, session_id: str) -> httpx.Response:
    with api(stack) as http:
        return http.get(f"/sessions/{session_id}")


def documents(stack: Stack, session_id: str) -> list[dict]:
    with api(stack) as http:
        listed = http.get(f"/sessions/{session_id}/documents")
    listed.raise_for_status()
    return [{k: d[k] for k in ("id", "status")} for d in listed.json()["data"]]


def wait_for(what: str, check: Any, timeout: float = 120, every: float = 2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(every)


def upload(stack: Stack, text: str) -> dict:
    """A new session with `text` uploaded and read (the test fails if it is not): the session."""
    with api(stack) as http:
        session = http.post("/sessions", json={}).json()
        url = f"/sessions/{session['id']}/documents"
        doc = http.post(url, json={"name": "passkey.txt", "text": text}).json()

        def read() -> dict | None:
            found = http.get(f"{url}/{doc['id']}").json()
            return found if found["status"] in ("ready", "failed") else None

        ready = wait_for("the document read", read, timeout=900)
    assert ready["status"] == "ready", ready
    return session


def test_chat_and_a_stream_through_the_proxy(stack: Stack) -> None:
    with client(stack) as c:
        model = c.models.list().data[0].id
        question = [{"role": "user", "content": "Name three colours."}]
        answer = c.chat.completions.create(
            model=model,
            messages=question,
            max_tokens=16,
            temperature=0,  # type: ignore[arg-type]
        )
        text = answer.choices[0].message.content
        stream = c.chat.completions.create(
            model=model, messages=question, max_tokens=16, temperature=0, stream=True,  # type: ignore[arg-type]
        )  # fmt: skip
        pieces = [
            ch.choices[0].delta.content
            for ch in stream
            if ch.choices and ch.choices[0].delta.content
        ]
    assert text and len(pieces) > 1, (text, pieces)
    assert "".join(pieces) == text  # greedy: the stream is the same answer, in pieces
    # the image built every CPU kernel: a replica that answered has loaded its decode kernels
    # without a compiler (plain_step was once left out of the build, and decode ran torch's ops)
    missing = re.findall(r"CPU kernel (\w+) unavailable", stack.logs(tail=5000))
    assert not missing, f"kernels the image did not build: {sorted(set(missing))}"


def test_prometheus_scrapes_both_replicas_and_answers_promql(stack: Stack) -> None:
    def targets_up() -> dict[str, int]:
        found = httpx.get(f"{stack.prometheus}/api/v1/targets", timeout=10).json()
        up: dict[str, int] = {}
        for target in found["data"]["activeTargets"]:
            if target["health"] == "up":
                up[target["labels"]["job"]] = up.get(target["labels"]["job"], 0) + 1
        complete = up.get("longserve-server") == 2 and up.get("longserve-memory-store") == 1
        return up if complete else {}

    wait_for("both replicas and the memory service scraped up", targets_up, timeout=180)

    def tokens_by_replica() -> list[dict]:
        query = "sum by (instance) (longserve:prompt_tokens_total)"
        answer = httpx.get(f"{stack.prometheus}/api/v1/query", params={"query": query}, timeout=10)
        result = answer.json()["data"]["result"]
        return result if len(result) == 2 and sum(float(r["value"][1]) for r in result) > 0 else []

    wait_for("a PromQL sum over the replicas' longserve: metrics", tokens_by_replica, timeout=120)


def test_a_session_is_read_and_answered_by_one_replica(stack: Stack, state: dict) -> None:
    servers = stack.containers("server")
    assert len(servers) == 2
    answered = {c: stack.metric(c, "longserve:request_success_total") for c in servers}
    session = upload(stack, DOCUMENT)
    with client(stack, session["id"]) as c:
        model = c.models.list().data[0].id
        completion = c.completions.create(
            model=model, prompt=QUESTION, max_tokens=8, temperature=0,
            extra_body={"session_id": session["id"]},
        )  # fmt: skip
    assert str(KEY) in completion.choices[0].text
    messages: list[dict] = []
    for question in TURNS:
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": chat(stack, session["id"], messages)})

    grew = {c: stack.metric(c, "longserve:request_success_total") - answered[c] for c in servers}
    holders = [c for c, n in grew.items() if n > 0]
    assert len(holders) == 1 and grew[holders[0]] == 1 + len(TURNS), grew  # the same replica
    assert stack.metric(holders[0], "longserve:ingest_tokens_total") >= 1000
    state.update(session=session["id"], messages=messages, holder=holders[0])
    state["other"] = next(c for c in servers if c != holders[0])


def test_killing_its_replica_keeps_the_conversation(stack: Stack, state: dict) -> None:
    session_id, other = state["session"], state["other"]
    before = session_object(stack, session_id).json()
    read_before = stack.metric(other, "longserve:ingest_tokens_total")
    stack.kill(state["holder"])  # SIGKILL, mid-conversation

    # No client retry: the proxy sends the request on to the live replica itself (decision 063).
    follow = [*state["messages"], {"role": "user", "content": "Repeat your last answer."}]
    answer = chat(stack, session_id, follow)
    after = session_object(stack, session_id).json()
    assert answer and after["turns"] == before["turns"] + 1, (before, after)
    assert stack.metric(other, "longserve:ingest_tokens_total") == read_before  # nothing re-read
    state["turns"] = after["turns"]
    state["messages"] = [*follow, {"role": "assistant", "content": answer}]

    stack.start(state["holder"])
    stack.wait_healthy()


def test_redis_and_the_memory_service_killed_and_restarted_lose_nothing(
    stack: Stack, state: dict
) -> None:
    session_id = state["session"]
    docs = documents(stack, session_id)
    store = [c for service in ("redis", "memory-store") for c in stack.containers(service)]
    for container in store:
        stack.kill(container)
    for container in store:
        stack.start(container)
    stack.wait_healthy()

    after = session_object(stack, session_id)
    assert after.status_code == 200, after.text
    assert after.json()["turns"] == state["turns"]
    assert documents(stack, session_id) == docs and all(d["status"] == "ready" for d in docs)
    # the same conversation, one turn on (a chat that drops turns starts a new one: `turns`
    # counts the answers of the conversation held, docs/api.md)
    follow = [*state["messages"], {"role": "user", "content": "What is the pass key?"}]
    answer = chat(stack, session_id, follow)
    assert answer and session_object(stack, session_id).json()["turns"] == state["turns"] + 1
    state["turns"] += 1


def test_down_and_up_keep_sessions_and_responses_and_down_v_removes_them(
    stack: Stack, state: dict
) -> None:
    session_id = state["session"]
    with api(stack) as http:
        model = http.get("/models").json()["data"][0]["id"]
        stored = http.post(
            "/responses", json={"model": model, "input": "Say hi.", "max_output_tokens": 8}
        )
    assert stored.status_code == 200, stored.text
    response_id, output = stored.json()["id"], stored.json()["output"]

    stack.down()
    FIGURES["time_to_healthy_after_down_up_seconds"] = round(stack.up(*SERVICES, scale=REPLICAS), 1)
    kept = session_object(stack, session_id)
    assert kept.status_code == 200 and kept.json()["turns"] == state["turns"], kept.text
    with api(stack) as http:
        again = http.get(f"/responses/{response_id}")
    assert again.status_code == 200 and again.json()["output"] == output, again.text

    stack.down(volumes=True)
    stack.up(*SERVICES, scale=REPLICAS)
    assert session_object(stack, session_id).status_code == 404
    with api(stack) as http:
        assert http.get(f"/responses/{response_id}").status_code == 404
