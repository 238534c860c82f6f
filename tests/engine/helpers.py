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


async def complete_on_session(http, model_id: str, session_id: str):
    """A short completion on a session through the API (an httpx client on the app): it reads
    a 400-token prompt into the session's memory and answers 4 tokens."""
    return await http.post(
        "/v1/completions",
        json={
            "model": model_id,
            "prompt": "The river ran slowly past the mill. " * 40 + "Where did it run?",
            "max_tokens": 4,
            "temperature": 0,
            "session_id": session_id,
        },
    )
