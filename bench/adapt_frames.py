"""Training examples for `longserve adapt --frames`: a task's passage read into a session
memory the way the server reads an upload, each question asked the way a session chat asks it,
and the prompt the answer then sees: the frame's tokens (sinks, the retrieved rows in the
prior's order, the window with the question) read afresh, then the assistant header
(engine/sessions/frame_text.py). The adapter trained on contiguous passages took list answers'
form around one value; the served answer reads a frame of retrieved blocks, not a passage
(docs/decisions/081-multivalue-trace.md).

The answer is the task's sentence with what the frame holds: a list's values in the order the
frame gives them, a value the frame lacks left out, a question whose frame holds none of its
values skipped (the adapter should copy, never invent).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from bench.adapt_tasks import Task, listed
from bench.recall_corpus import LONG_NUMBER
from engine.config import EngineConfig
from engine.memory.config import MemorySpec
from engine.memory.session import SessionMemory
from engine.runner.chat_template import encode_chat, encode_document
from engine.runner.loader import load_model
from engine.sessions.memory_state import MemoryState
from engine.sessions.prior_query import prior_encoder, prior_query


def framed_answer(sentence: str, frame_text: str) -> str | None:
    """The sentence naming only the values the frame holds, a list's in the frame's order; None
    when it holds none."""
    values = LONG_NUMBER.findall(sentence)
    held = sorted((frame_text.find(v), v) for v in values if v in frame_text)
    if not held:
        return None
    if len(values) == 1:
        return sentence
    if listed(values) in sentence:
        return sentence.replace(listed(values), listed([v for _, v in held]))
    own = {LONG_NUMBER.search(s).group(): s for s in re.split(r"(?<=\.) ", sentence)}
    return " ".join(own[v] for _, v in held)  # each value's own sentence, in the frame's order


class FrameReader:
    """The engine's model and default session memory, reading tasks into frames."""

    def __init__(
        self, lead: int, model: str | None = None, knobs: dict | None = None, strategy="segments"
    ) -> None:
        config = EngineConfig(model=model)
        self.loaded = load_model(config)
        self.encoder = prior_encoder(config)
        self.chunk = config.prefill_chunk_tokens
        self.lead, self.strategy = lead, strategy
        self.spec = MemorySpec(strategy, dict(knobs or {}))  # the server's defaults, or these

    def examples(self, task: Task) -> Iterator[tuple[list[int], str]]:
        """(prompt ids as the answer reads them, answer sentence) for each question of task."""
        tokenizer, model = self.loaded.tokenizer, self.loaded.model
        base = SessionMemory(model, self.spec, self.loaded.kv_dtype)
        if self.encoder is not None:
            base.attach_prior(self.encoder, lambda t: str(tokenizer.decode(list(t))))
        ids = encode_document(tokenizer, task.passage)
        with torch.inference_mode():
            for start in range(0, len(ids), self.chunk):
                base.append(torch.tensor(ids[start : start + self.chunk]), document=True)
            base.end_document()
        history = [("user", task.passage)]
        for question, sentence in task.questions:
            messages = [{"role": "user", "content": question}]
            memory = base.fork()
            memory.set_query(prior_query(messages))
            prompt = encode_chat(tokenizer, messages, history)
            memory.forget_selection()
            with torch.inference_mode():
                MemoryState(memory, self.strategy).prefill(torch.tensor(prompt[: -self.lead]))
            frame = memory.frame_ids()
            del memory
            if frame is None:  # nothing retrieved: the passage fits the window
                continue
            said = framed_answer(sentence, str(tokenizer.decode(frame)))
            if said is not None:
                yield frame + prompt[-self.lead :], said
