"""The `cluster` profile: the same stack with the memory service on the 6-node Redis Cluster
(3 primaries, 3 replicas, AOF fsync always). A session is read and answered; the primary holding
its hash slot is killed; once its replica has taken over, every acknowledged document and turn
is there and the conversation goes on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.test_replicas import DOCUMENT
from tests.stack import images
from tests.stack.engine import run
from tests.stack.figures import FIGURES
from tests.stack.stack import Stack
from tests.stack.test_stack import (
    TURNS,
    chat,
    documents,
    session_object,
    upload,
    wait_for,
)

pytestmark = [pytest.mark.stack, pytest.mark.timeout(2400)]

SCALE = {"server": 2, "memory-store": 0, "redis": 0}
SERVICES = ("proxy", "server", "memory-store-cluster", "prometheus")


@pytest.fixture(scope="module")
def cluster(built: dict[str, images.Built], log_dir: Path) -> Iterator[Stack]:
    stack = Stack("longserve-stack-cluster", log_dir, profiles=("cluster",))
    stack.down(volumes=True)
    try:
        FIGURES["cluster_time_to_healthy_seconds"] = round(stack.up(*SERVICES, scale=SCALE), 1)
        yield stack
    finally:
        stack.save_logs()
        stack.down(volumes=True)


def redis_cli(node: str, *args: str) -> str:
    return run("docker", "exec", node, "redis-cli", *args).stdout


def primary_of(cluster: Stack, session_id: str) -> str:
    """The container of the primary that serves the session's hash tag (`{sess:ID}`)."""
    node = cluster.containers("redis-node-1")[0]
    slot = int(redis_cli(node, "cluster", "keyslot", f"sess:{session_id}").strip())
    for line in redis_cli(node, "cluster", "nodes").splitlines():
        fields = line.split()
        if "master" not in fields[2] or "fail" in fields[2]:
            continue
        for served in fields[8:]:
            low, _, high = served.partition("-")
            if low.isdigit() and int(low) <= slot <= int(high or low):
                address = fields[1].split(":")[0]
                for i in range(1, 7):
                    for container in cluster.containers(f"redis-node-{i}"):
                        if cluster.address(container) == address:
                            return container
    raise AssertionError(f"no primary serves slot {slot}")


def test_a_session_survives_its_primary_killed(cluster: Stack) -> None:
    session = upload(cluster, DOCUMENT)
    messages: list[dict] = []
    for question in TURNS:
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": chat(cluster, session["id"], messages)})
    docs = documents(cluster, session["id"])
    turns = session_object(cluster, session["id"]).json()["turns"]

    primary = primary_of(cluster, session["id"])
    cluster.kill(primary)

    def served() -> bool:  # 503 memory_store_unavailable while the shard fails over
        return session_object(cluster, session["id"]).status_code == 200

    wait_for("the session served after the failover", served, timeout=120)
    assert session_object(cluster, session["id"]).json()["turns"] == turns
    assert documents(cluster, session["id"]) == docs
    # Writes to the shard wait for a replica's copy: they get 503 until the old primary is back
    # (as the new primary's replica), which is what an operator restarting it gets.
    cluster.start(primary)
    follow = [*messages, {"role": "user", "content": "Repeat your last answer."}]

    def answered() -> str:
        try:
            return chat(cluster, session["id"], follow)
        except openai.APIStatusError as error:
            assert error.status_code == 503, error
            return ""

    assert wait_for("a new turn once the old primary rejoined", answered, timeout=180)
    assert session_object(cluster, session["id"]).json()["turns"] == turns + 1
