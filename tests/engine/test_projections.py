"""Projections by id (engine/memory/projections.py): only regular files inside the operator's
directory, size-capped, tensors only; every refusal names the id and nothing else."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from engine.memory.projections import Projections
from engine.protocol import InvalidRequest


class Planted:
    """A pickle that runs code when unpickled: torch.load(weights_only=False) would call it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def save(path: Path, d: int = 4, hidden: int = 8) -> None:
    torch.save({"weight": torch.randn(d, hidden), "mean": torch.zeros(hidden)}, path)


def refusal(projections: Projections, projection_id: str) -> str:
    with pytest.raises(InvalidRequest) as e:
        projections.load(projection_id)
    assert e.value.param == "memory.projection"
    message = str(e.value)
    assert "/" not in message and "Errno" not in message, message
    return message


def test_an_id_loads_its_file_once_until_it_changes(tmp_path: Path) -> None:
    save(tmp_path / "pca.pt")
    projections = Projections(str(tmp_path), max_bytes=2**20)
    weight, mean = projections.load("pca")
    assert weight.shape == (4, 8) and mean.shape == (8,) and weight.dtype == torch.float32
    assert projections.load("pca")[0] is weight  # held, not read again
    save(tmp_path / "pca.pt", d=2)
    os.utime(tmp_path / "pca.pt", ns=(1, 1))  # a new version, whatever the clock's resolution
    assert projections.load("pca")[0].shape == (2, 8)


@pytest.mark.parametrize("bad", ["../pca", "/etc/hostname", ".pca", "pca/x", "", "a" * 65, "p\\x"])
def test_only_ids_are_accepted(tmp_path: Path, bad: str) -> None:
    save(tmp_path / "pca.pt")
    message = refusal(Projections(str(tmp_path), max_bytes=2**20), bad)
    assert message.startswith("memory.projection must be a projection id")


def test_no_directory_knows_no_id(tmp_path: Path) -> None:
    assert refusal(Projections(None, max_bytes=2**20), "pca") == "unknown projection 'pca'"


def test_a_symlink_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    save(outside / "real.pt")
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "link.pt").symlink_to(outside / "real.pt")
    assert refusal(Projections(str(inside), 2**20), "link") == "unknown projection 'link'"


def test_a_fifo_or_a_directory_is_refused_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.pt")  # nobody writes it: reading it would block forever
    (tmp_path / "dir.pt").mkdir()
    projections = Projections(str(tmp_path), 2**20)
    done: list[str] = []
    worker = threading.Thread(target=lambda: done.append(refusal(projections, "fifo")))
    worker.start()
    worker.join(timeout=10)
    assert done == ["unknown projection 'fifo'"]
    assert refusal(projections, "dir") == "unknown projection 'dir'"


def test_a_file_over_the_cap_is_not_read(tmp_path: Path) -> None:
    save(tmp_path / "big.pt", d=64, hidden=256)
    size = (tmp_path / "big.pt").stat().st_size
    message = refusal(Projections(str(tmp_path), max_bytes=size - 1), "big")
    assert message == "projection 'big' cannot be used; ask the operator"
    assert Projections(str(tmp_path), max_bytes=size).load("big")[0].shape == (64, 256)


@pytest.mark.parametrize("content", ["text", "code", "shape"])
def test_a_file_that_is_not_a_projection_is_refused(tmp_path: Path, content: str) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "bad.pt"
    if content == "text":
        path.write_text("root:x:0:0:root:/root:/bin/bash\n")
    elif content == "code":
        torch.save({"weight": Planted(marker), "mean": torch.zeros(8)}, path)
    else:
        torch.save({"weight": [1, 2, 3], "mean": torch.zeros(8)}, path)
    message = refusal(Projections(str(tmp_path), 2**20), "bad")
    assert message == "projection 'bad' cannot be used; ask the operator"
    assert not marker.exists()  # weights_only: the pickle's code never ran
