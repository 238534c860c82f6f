"""A document is the session's once its last progress (done=True) is out: a consumer that closes
the stream there, as the server does, finds it read, whatever the worker does next.

The root cause of issue 45 (docs/decisions/055): through the memory store, the session took
the document (its documents' end, where new chats restart) one device step after done=True. The
server's close reached the worker first whenever other requests held the device, so the
session kept its documents' end at 0 tokens: every new chat then followed the conversation
held, and `turns` counted up. Here the steps are closed right at done, as that race ends."""

from __future__ import annotations

import pytest

from engine.memory.strategies import STRATEGIES
from engine.protocol import MemorySpec, SamplingParams, StoreUnavailableError
from engine.scheduler.stream import on_device
from memory_store.errors import StoreUnavailableError as StoreDown

from .test_memory_session import SMALL
from .test_store_integration import DOC

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def ingest_closed_at_done(engine, session_id: str) -> list:
    """Run the session's ingestion on the device thread and close it at its last progress
    (or its outage error): what the worker does when the consumer's abort comes first."""
    sessions = engine._frame_backend

    def run() -> list:
        seen = []
        steps = sessions._ingest_steps(f"ingest-{session_id}", session_id, DOC)
        try:
            for progress in steps:
                if progress is not None:
                    seen.append(progress)
                    if progress.done:
                        break
        except StoreUnavailableError as e:
            seen.append(e)
        finally:
            steps.close()
        return seen

    return on_device(engine._worker, run)


async def turns_after(engine, session_id: str, question: str) -> int:
    """A new chat's `turns` (finished turns the session holds after it)."""
    messages = [{"role": "user", "content": question}]
    turns = None
    async for delta in engine.generate("q-" + question, messages, GREEDY, session_id=session_id):
        turns = delta.turns or turns
    assert turns is not None
    return turns[-1].turns


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("store", ["embedded", "none", "down"])
async def test_a_document_is_read_when_done_is_out(engines, monkeypatch, strategy, store):
    engine = engines(data_dir=None) if store == "none" else engines()
    if store == "down":

        async def down(*args, **kwargs):
            raise StoreDown("connection refused")

        monkeypatch.setattr(engine._store.client, "get_chunk", down)
        monkeypatch.setattr(engine._store.client, "put_chunk", down)
    await engine.create_session("s", MemorySpec(strategy, SMALL[strategy]))
    seen = await ingest_closed_at_done(engine, "s")
    last = seen[-1]
    if store == "down":
        assert isinstance(last, StoreUnavailableError)  # read into memory all the same
        monkeypatch.undo()  # the store is back for the chats
    else:
        assert last.done and last.tokens_done == last.tokens_total > 0

    session = engine._frame_backend.conversations["s"]
    assert session.documents_end.state_hash == session.memory.state_hash
    assert session.documents_rendered == [("user", DOC)]
    # two different new chats: each restarts after the document, so each holds one turn
    assert await turns_after(engine, "s", "What is the access code?") == 1
    assert await turns_after(engine, "s", "How did the river run?") == 1
