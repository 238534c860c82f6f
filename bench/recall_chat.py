"""How bench.recall asks the server: one question's chat through the official openai SDK
(greedy, the question alone, one or two turns), and a session holding a document uploaded and
read through longserve's sessions API."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from bench.recall_tasks import Question, Trial, answer_budget, is_correct


@dataclass
class Answer:
    correct: bool
    seconds: float
    context_tokens: int
    text: str
    expected: tuple[str, ...]
    error: str | None = None
    prompt_tokens: int = 0  # the server's count: a baseline's must fit the window
    question: str = ""  # kind:trial:index, the same in every mode: the pairs McNemar compares
    paraphrased: bool = False


class Asker:
    """Chats with the server: one question (one or two turns) per call."""

    def __init__(self, client, model: str, max_tokens: int) -> None:
        self.client, self.model, self.max_tokens = client, model, max_tokens

    def chat(self, question: Question, context_for, extra_body: dict) -> tuple[list[str], int, int]:
        """Answers to each turn. context_for(turn, question, previous answer) gives the text to
        put before a turn's question and its tokens, or None for the question alone. Also
        returns the first context's tokens and the largest prompt the server counted."""
        messages: list[dict] = []
        answers: list[str] = []
        context_tokens = prompt_tokens = 0
        for turn, text in enumerate(question.turns):
            context = context_for(turn, text, answers[-1] if answers else "")
            if context is not None:
                text = f"{context[0]}\n\n{text}"
                context_tokens = context_tokens or context[1]
            messages.append({"role": "user", "content": text})
            reply = self.client.chat.completions.create(
                model=self.model,
                messages=messages,
                temperature=0,
                max_tokens=answer_budget(self.max_tokens, question),
                extra_body=extra_body,
            )
            answers.append(reply.choices[0].message.content or "")
            messages.append({"role": "assistant", "content": answers[-1]})
            if reply.usage is not None:
                prompt_tokens = max(prompt_tokens, reply.usage.prompt_tokens)
        return answers, context_tokens, prompt_tokens


def ask_all(asker: Asker, trial: Trial, context_for, extra_body: dict) -> list[Answer]:
    out = []
    for question in trial.questions:
        started = time.perf_counter()
        try:
            answers, tokens, prompt_tokens = asker.chat(question, context_for, extra_body)
        except Exception as e:  # a failed request is a wrong answer, and is reported
            out.append(Answer(False, 0.0, 0, "", question.expected, f"{type(e).__name__}: {e}"))
            continue
        correct = is_correct(answers[-1], question.expected, exact=question.task == "multivalue")
        out.append(
            Answer(
                correct,
                time.perf_counter() - started,
                tokens,
                " | ".join(answers),
                question.expected,
                prompt_tokens=prompt_tokens,
            )
        )
    return out


def upload(http: httpx.Client, memory: dict, text: str, timeout: float) -> tuple[str, int, float]:
    """A session of `memory` (strategy and knobs) holding `text`, read: (id, the server's token
    count, seconds)."""
    started = time.perf_counter()
    session = http.post("/sessions", json={"memory": memory}).json()
    if "id" not in session:
        raise RuntimeError(f"session refused: {session}")
    response = http.post(
        f"/sessions/{session['id']}/documents", json={"name": "document.txt", "text": text}
    )
    doc = response.json()
    if "id" not in doc:
        raise RuntimeError(f"upload refused: {doc}")
    deadline = time.monotonic() + timeout
    while doc["status"] not in ("ready", "failed"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"document not read after {timeout} s")
        time.sleep(1)
        doc = http.get(f"/sessions/{session['id']}/documents/{doc['id']}").json()
    if doc["status"] != "ready":
        raise RuntimeError(f"document failed: {doc.get('error')}")
    return session["id"], doc["tokens"], time.perf_counter() - started
