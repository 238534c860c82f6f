"""What several engine tests share: small memory specs of every strategy, a recorder of the
worker's batch sizes, and the arguments of `longserve ingest`."""

from __future__ import annotations

import json
from pathlib import Path

from engine.protocol import MemorySpec

FRAME = {"sinks": 8, "local_window": 32, "chunk_size": 32, "block": 16}
SPECS = {
    "segments": MemorySpec("segments", {**FRAME, "k": 2, "u": 1}),
    "tokens": MemorySpec("tokens", {**FRAME, "k": 16, "index": "torch"}),
    "neurocache": MemorySpec(
        "neurocache", {**FRAME, "k": 4, "w": 2, "c": 2, "r": 0, "fit_tokens": 32, "d": 8}
    ),
}


def record_batches(engine) -> list[int]:
    """The sizes of the batches the engine's worker runs from now on, appended as they run."""
    sizes: list[int] = []
    run = engine._worker._run_batch

    def recording(steps):
        sizes.append(len(steps))
        return run(steps)

    engine._worker._run_batch = recording
    return sizes


def ingest_args(
    files: list[str], data_dir: Path, model_dir: Path, spec: MemorySpec, collection: str
) -> list[str]:
    """`longserve ingest` reading `files` into `collection` on CPU."""
    return [
        *files,
        "--collection",
        collection,
        "--data-dir",
        str(data_dir),
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--memory",
        json.dumps(spec.params),
    ]
