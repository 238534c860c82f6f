"""Memory knobs cannot name server files: neurocache's projection is an id the operator's
--projection-dir resolves, and no refusal carries a path, an errno or exception text."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import httpx
import pytest
import torch

from tests.e2e.conftest import API_KEY, ServerProcess, start_server, stop_server

HIDDEN, D = 576, 144  # the embedded SmolLM2-135M's hidden size, and neurocache's d (hidden/4)
LEAKS = ("/", "Errno", "No such file", "Permission", "pickle", "Traceback", "torch")


@pytest.fixture(scope="module")
def projections(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("projections")
    torch.save(
        {"weight": torch.randn(D, HIDDEN), "mean": torch.zeros(HIDDEN)}, directory / "pca.pt"
    )
    (directory / "junk.pt").write_text("not a torch file\n")
    os.symlink("/etc/hostname", directory / "outside.pt")
    os.mkfifo(directory / "fifo.pt")
    return directory


@pytest.fixture(scope="module")
def projection_server(tmp_path_factory, projections) -> Iterator[ServerProcess]:
    with mock.patch.dict(os.environ, {"LONGSERVE_PROJECTION_DIR": str(projections)}):
        proc = start_server(tmp_path_factory.mktemp("projections-e2e"))
    yield proc
    stop_server(proc)


@pytest.fixture
def http(projection_server) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=projection_server.api_base, headers=headers, timeout=120) as client:
        yield client


@pytest.fixture
def model_id(http) -> str:
    return str(http.get("/models").json()["data"][0]["id"])


def neurocache(**knobs: object) -> dict[str, object]:
    return {"memory": {"strategy": "neurocache", **knobs}}


def assert_refused(response: httpx.Response, param: str, *, names: str | None = None) -> None:
    """A clean 400 in OpenAI's shape that names at most the client's own id."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for leak in LEAKS:
        assert leak not in error["message"], error["message"]
    if names is not None:
        assert repr(names) in error["message"], error["message"]


def session_count(http: httpx.Client) -> int:
    return len(http.get("/sessions").json()["data"])


@pytest.mark.parametrize("path", ["/nonexistent/wp.pt", "/etc/hostname", "/proc/self/environ"])
def test_a_projection_path_is_refused_and_no_file_is_touched(http, model_id, path):
    before = session_count(http)
    assert_refused(
        http.post("/sessions", json=neurocache(projection_path=path)), "memory.projection_path"
    )
    chat = {
        "model": model_id,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        **neurocache(projection_path=path),
    }
    assert_refused(http.post("/chat/completions", json=chat), "memory.projection_path")
    completion = {
        "model": model_id,
        "prompt": "hi",
        "max_tokens": 1,
        **neurocache(projection_path=path),
    }
    assert_refused(http.post("/completions", json=completion), "memory.projection_path")
    response = {
        "model": model_id,
        "input": "hi",
        "max_output_tokens": 1,
        **neurocache(projection_path=path),
    }
    assert_refused(http.post("/responses", json=response), "memory.projection_path")
    assert session_count(http) == before


@pytest.mark.parametrize(
    ("projection", "named"),
    [
        ("missing", "missing"),  # no such id
        ("outside", "outside"),  # a symlink out of the directory is never followed
        ("fifo", "fifo"),  # not a regular file: refused without opening it for reading
        ("junk", "junk"),  # not a torch file
        ("../../etc/hostname", None),  # not an id at all
        ("/etc/hostname", None),
        (".hidden", None),
    ],
)
def test_an_unusable_projection_id_is_a_clean_400(http, projection, named):
    before = session_count(http)
    response = http.post("/sessions", json=neurocache(projection=projection))
    assert_refused(response, "memory.projection", names=named)
    assert session_count(http) == before


def test_a_projection_from_the_directory_is_used_and_stored_by_id(http, model_id):
    session = http.post("/sessions", json=neurocache(projection="pca"))
    assert session.status_code == 200, session.text
    body = session.json()
    assert body["memory"]["params"] == {"projection": "pca"}
    chat = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = http.post("/chat/completions", json={**chat, "session_id": body["id"]})
    assert answer.status_code == 200, answer.text
    listed = http.get(f"/sessions/{body['id']}").json()
    assert listed["memory"]["params"] == {"projection": "pca"}
    assert http.delete(f"/sessions/{body['id']}").status_code == 200
