"""The README's examples, run as written against a live server of the embedded model: every
fenced block of "One example per API", in order, Python in one namespace and shell with bash,
with only the address changed (the server is on a free port, not 8000). As the README says,
it is a server with no API key, on loopback, with its default data directory (./data, here a
temporary directory). Each block's output is then held to what its comment claims; a new block
without a check here fails the test."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import HOST, free_port, wait_for_process

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## One example per API"
BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.M | re.S)


def examples() -> list[tuple[str, str]]:
    """(language, code) of each fenced block in the README's section of examples."""
    text = (ROOT / "README.md").read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return BLOCK.findall(text[start:end])


def contract() -> str:
    """A lease of ~10K tokens (past the 8,192-token window), the deposit clause in the middle."""
    duties = ["keeps the garden tidy", "repairs the gutters", "pays the water bill",
              "heats the rooms in winter", "keeps the stairs clear", "services the boiler"]  # fmt: skip
    clauses = [
        f"Clause {i}. The {'tenant' if i % 2 else 'landlord'} {duties[i % len(duties)]} "
        f"during the {i % 12 + 1}th month of every year of this lease, as agreed."
        for i in range(1, 381)
    ]
    clauses[190] = "Clause 191. The tenant pays a deposit of 2,000 euros by 1 March 2027."
    return "\n".join(clauses)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("readme")
    # prose, not one sentence repeated: over a looped text the adapter's answer copied the loop
    # for all of its 4,096 tokens (two minutes of this test)
    (path / "book.txt").write_text(
        "I was born in a small harbour town on the northern coast. My father mended nets and my "
        "mother kept the lighthouse accounts. My brother Tom, two years older, taught me to sail "
        "before I could read. In winter the harbour froze at its edges, and we skated between "
        "the moored boats. When I was twelve, a storm took our boat, and Tom swam out to save "
        "the old ferryman. After that the town called him the quiet captain. I left for the city "
        "at eighteen to study law, and I did not see the sea again for nine years."
    )
    for i in range(2):
        (path / f"manual-{i}.txt").write_text(f"Manual {i}. Press the red button to stop. " * 40)
    return path


@pytest.fixture(scope="module")
def keyless_server(workdir: Path) -> Iterator[str]:
    """`longserve serve` as `make serve` runs it (no key, loopback, ./data), on a free port."""
    port = free_port()
    log_path = workdir / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", HOST, "--port", str(port)]
    with log_path.open("wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    base = f"http://{HOST}:{port}"
    try:
        wait_for_process(
            process, f"{base}/ready", lambda: log_path.read_text(errors="replace")[-5000:], 240
        )
        yield base
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def run_python(code: str, namespace: dict[str, Any]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<README>", "exec"), namespace)  # noqa: S102 - the README's own code
    return out.getvalue()


def run_bash(code: str, cwd: Path) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # `longserve`
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        ["bash", "-c", f"set -eo pipefail\n{code}"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{code}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


# What each block's comment (or its text) claims, in the README's order.
def _client(ns: dict, out: str) -> None:
    assert ns["model"] == "SmolLM2-135M-Instruct"


def _chat(ns: dict, out: str) -> None:
    assert "Paris" in out  # The capital of France is Paris.


def _stream(ns: dict, out: str) -> None:
    text, _, usage = out.rstrip("\n").rpartition("\n")
    assert "Paris" in text
    assert "CompletionUsage(" in usage and "prompt_tokens=" in usage  # the last chunk: usage


def _completions(ns: dict, out: str) -> None:
    events = [line.removeprefix("data: ") for line in out.splitlines() if line.startswith("data")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]).strip()


def _parse(ns: dict, out: str) -> None:
    parsed = ns["reply"].choices[0].message.parsed
    assert isinstance(parsed, ns["City"]) and ns["reply"].choices[0].finish_reason == "stop"
    assert out.startswith("name='Paris' country=")  # name='Paris' country='FRANCE' ...
    assert isinstance(parsed.population, int)


def _tools(ns: dict, out: str) -> None:
    call = ns["call"]  # get_weather {"city":"Paris"}
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def _responses(ns: dict, out: str) -> None:
    second = ns["second"]
    assert second.previous_response_id == ns["first"].id and second.output_text.strip()
    assert second.usage.input_tokens_details.cached_tokens > 0  # the chain's prefix, reused


def _inline(ns: dict, out: str) -> None:
    reply = ns["reply"]
    assert reply.choices[0].message.content.strip()
    assert reply.usage.prompt_tokens > 8192  # past the window: read into a memory


def _session(ns: dict, out: str) -> None:
    assert ns["session"]["id"].startswith("sess_")
    assert ns["reply"].choices[0].message.content.strip()


def _adapter(ns: dict, out: str) -> None:
    reply = ns["reply"]  # the same session, answered through the recall adapter
    assert reply.model == "SmolLM2-135M-Instruct:recall" and reply.choices[0].message.content


def _collections(ns: dict, out: str) -> None:
    *ingested, session = out.strip().splitlines()  # a line per file read, then the session
    assert len(ingested) == 2 and json.loads(session)["collections"] == ["manuals"]


def _tokenize(ns: dict, out: str) -> None:
    body = json.loads(out)
    assert body["count"] == len(body["tokens"]) > 7 and body["max_model_len"] == 8192


def _metrics(ns: dict, out: str) -> None:
    assert "longserve:time_to_first_token_seconds_count" in out


CHECKS: list[Callable[[dict, str], None]] = [
    _client,
    _chat,
    _stream,
    _completions,
    _parse,
    _tools,
    _responses,
    _inline,
    _session,
    _adapter,
    _collections,
    _tokenize,
    _metrics,
]


@pytest.mark.timeout(900)  # every example in turn on the real model: ~5 min on a quiet 2-core CI
def test_every_example_runs_and_does_what_its_comment_says(
    keyless_server: str, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = examples()
    assert len(blocks) == len(CHECKS), "a README example was added or removed: check it here"
    monkeypatch.chdir(workdir)  # book.txt, manual-*.txt, ./data
    address = keyless_server.removeprefix("http://")
    namespace: dict[str, Any] = {"contract_text": contract()}
    for (language, code), check in zip(blocks, CHECKS, strict=True):
        code = code.replace("127.0.0.1:8000", address)
        out = run_python(code, namespace) if language == "python" else run_bash(code, workdir)
        try:
            check(namespace, out)
        except AssertionError as e:
            raise AssertionError(f"{check.__name__}: {e}\n{code}\n--- output:\n{out}") from e
