"""Two real `longserve serve` replicas over one `longserve memory-store` on a real Redis (AOF):
a session made on one is answered by the other without running the model over its document, and
survives kill -9 of Redis and the memory service, and a restart of the replica."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import (
    API_KEY,
    ServerProcess,
    start_server,
    start_servers,
    stop_server,
    upload_and_wait,
)
from tests.helpers import HOST, free_port, wait_for_process
from tests.redis_process import RedisProcess

pytestmark = pytest.mark.real_model

KEY = 7391
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "them. I will quiz you about the important information there."
)
FILLER = (
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
NEEDLE = f" The pass key is {KEY}. Remember it. {KEY} is the pass key."
DOCUMENT = INTRO + FILLER * 25 + NEEDLE + FILLER * 45  # about 1.5K tokens
QUESTION = "What is the pass key? The pass key is"


class MemoryServiceProcess:
    """`longserve memory-store` on Redis: start, kill -9, start again on the same port."""

    def __init__(self, directory: Path, redis_url: str) -> None:
        self.dir = directory
        self.redis_url = redis_url
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        log_path = self.dir / f"memory-store-{self.port}.log"
        cmd = [sys.executable, "-m", "server.cli", "memory-store", "--port", str(self.port),
               "--redis-url", self.redis_url]  # fmt: skip
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2]
            )
        wait_for_process(
            self.proc, f"{self.url}/ready", lambda: log_path.read_text(errors="replace"), timeout
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def redis(redis_server: RedisProcess) -> RedisProcess:
    """The memory-store tests' real redis-server (AOF on, fsync always)."""
    return redis_server


@pytest.fixture
def memory_service(tmp_path: Path, redis: RedisProcess) -> Iterator[MemoryServiceProcess]:
    service = MemoryServiceProcess(tmp_path, redis.url)
    service.start()
    try:
        yield service
    finally:
        service.kill()


def ingest_tokens(server: ServerProcess) -> float:
    match = re.search(r"^longserve:ingest_tokens_total (\S+)$", server.metrics(), re.M)
    assert match, "longserve:ingest_tokens_total missing"
    return float(match.group(1))


def ask(server: ServerProcess, session_id: str) -> str:
    with openai.OpenAI(base_url=server.api_base, api_key=API_KEY, max_retries=0) as client:
        model = client.models.list().data[0].id
        completion = client.completions.create(
            model=model,
            prompt=QUESTION,
            max_tokens=8,
            temperature=0,
            timeout=300,
            extra_body={"session_id": session_id},
        )
    return completion.choices[0].text


@pytest.mark.timeout(1800)  # four model loads and a 1.5K-token ingest on a shared CPU
def test_session_is_shared_by_replicas_and_survives_store_restart(
    tmp_path: Path, redis: RedisProcess, memory_service: MemoryServiceProcess
) -> None:
    first, second = start_servers(tmp_path, 2, "--memory-store", memory_service.url)
    try:
        session, _ = upload_and_wait(first.api_base, "passkey.txt", DOCUMENT, timeout_s=900)
        session_id = session["id"]
        assert ingest_tokens(first) >= 1000

        assert str(KEY) in ask(second, session_id), second.log()
        assert ingest_tokens(second) == 0

        redis.kill()
        memory_service.kill()
        redis.start()  # same port, same directory: the AOF brings everything back
        memory_service.start()
        stop_server(second)
        second = start_server(tmp_path, "--memory-store", memory_service.url)

        assert str(KEY) in ask(second, session_id), second.log()
        assert ingest_tokens(second) == 0
    finally:
        stop_server(first)
        stop_server(second)


TURNS = ["What is the pass key?", "Say it again, please.", "What colour is the sky?"]
FOLLOW_UP = "Repeat your last answer."


def chat(server: ServerProcess, session_id: str, messages: list[dict]) -> str:
    with openai.OpenAI(base_url=server.api_base, api_key=API_KEY, max_retries=0) as client:
        model = client.models.list().data[0].id
        completion = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
            timeout=300,
            extra_body={"session_id": session_id},
        )
    return completion.choices[0].message.content or ""


def conversation(server: ServerProcess, session_id: str) -> list[dict]:
    """The three turns, each resending the whole conversation (as chat clients do)."""
    messages: list[dict] = []
    for question in TURNS:
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": chat(server, session_id, messages)})
    return messages


def session_object(server: ServerProcess, session_id: str) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.get(f"{server.api_base}/sessions/{session_id}", headers=headers, timeout=60)
    response.raise_for_status()
    return response.json()


@pytest.fixture(params=["redis", "redis-cluster"])
def any_memory_service(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[MemoryServiceProcess]:
    """The memory service on a single Redis, then on a 3-primary Redis Cluster."""
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
    else:
        url = request.getfixturevalue("redis_cluster").url
    service = MemoryServiceProcess(tmp_path, url)
    service.start()
    try:
        yield service
    finally:
        service.kill()


@pytest.mark.timeout(1800)
def test_turns_survive_kill_9_of_the_replica_that_took_them(
    tmp_path: Path, any_memory_service: MemoryServiceProcess
) -> None:
    """Three turns on A; A is killed with -9; the fourth turn, on B, refers to the third answer
    and gets the tokens a replica that lived the conversation answers (B itself, on a second
    session that lives it), without B reading the document with the model."""
    memory_service = any_memory_service
    a, b = start_servers(tmp_path, 2, "--memory-store", memory_service.url)
    try:
        session, _ = upload_and_wait(a.api_base, "passkey.txt", DOCUMENT, timeout_s=900)
        messages = conversation(a, session["id"])
        seen_on_a = session_object(a, session["id"])
        assert seen_on_a["turns"] == 3
        a.process.kill()  # SIGKILL: nothing is flushed on the way out
        a.process.wait(timeout=30)

        on_b = session_object(b, session["id"])  # from the store, before any restore
        assert (on_b["turns"], on_b["memory_tokens"]) == (3, seen_on_a["memory_tokens"])
        follow = [*messages, {"role": "user", "content": FOLLOW_UP}]
        restored_answer = chat(b, session["id"], follow)
        assert ingest_tokens(b) == 0, b.log()  # turns imported, the document from encodings
        after = session_object(b, session["id"])
        assert after["turns"] == 4 and after["memory_tokens"] > seen_on_a["memory_tokens"]

        reference, _ = upload_and_wait(b.api_base, "passkey.txt", DOCUMENT, timeout_s=900)
        assert conversation(b, reference["id"]) == messages  # greedy: the same three answers
        assert restored_answer and chat(b, reference["id"], follow) == restored_answer
    finally:
        stop_server(a)
        stop_server(b)
