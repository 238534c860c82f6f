"""Upload once, ask many times, with the real model: a ~30K-token document (well past the
model's 8K window) with three facts planted at different depths is read into a session, three
questions in separate requests each find their fact, and a fourth question needs the third
answer, which only the session's memory holds.

The client resends the whole conversation every time, as openai-SDK code usually does; the
session appends only the new question (usage.prompt_tokens says so), so the fourth answer comes
from the memory, not from the prompt.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from .conftest import API_KEY
from .haystack import haystack

pytestmark = pytest.mark.real_model

DOCUMENT_TOKENS = 30_000
CHARS_PER_TOKEN = 5.2  # SmolLM2's tokenizer on the haystack's prose (measured: 5.26)
FACTS = (
    (0.15, "The code name of the harbor project is Bluefinch."),
    (0.5, "The locker code of the harbor office is 4817."),
    (0.85, "The harbor project is based in the city of Valparaiso."),
)
QUESTIONS = (
    ("Question: What is the code name of the harbor project? Answer:", "Bluefinch"),
    ("Question: What is the locker code of the harbor office? Answer:", "4817"),
    ("Question: In which city is the harbor project based? Answer:", "Valparaiso"),
    ("What did you just tell me the city was? Answer with the city name only.", "Valparaiso"),
)
# The new question and the template around it; the whole conversation would be far longer.
MAX_APPENDED_PROMPT_TOKENS = 64


# Measured in process with the default memory knobs (segments k 8 u 1, read_retrieval 0), same
# document and questions, greedy: all three answers were wrong (the model restated the question
# and made up the rest: 'The code name of the harbor project is "HARRI', 'The harbor project is
# based in New York City, New York'). Strict: when recall is fixed, this fails until the marker
# goes.
@pytest.mark.xfail(strict=True, reason="SmolLM2-135M does not recall facts at 30K tokens "
                   "through segments memory with the default knobs (measured; see the comment)")
@pytest.mark.timeout(1800)  # ~75 s of reading on an idle 2-core CPU, far more on a shared one
def test_three_facts_and_a_follow_up_from_a_long_document(server):
    started = time.monotonic()
    document = haystack(lambda text: int(len(text) / CHARS_PER_TOKEN), DOCUMENT_TOKENS, FACTS)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.api_base, headers=headers, timeout=60) as http:
        session = http.post("/sessions", json={}).json()
        doc = http.post(f"/sessions/{session['id']}/documents",
                        json={"name": "harbor.txt", "text": document}).json()
        deadline = time.monotonic() + 900
        while doc["status"] not in ("ready", "failed"):
            assert time.monotonic() < deadline, f"not read after 900 s: {doc}"
            time.sleep(1)
            doc = http.get(f"/sessions/{session['id']}/documents/{doc['id']}").json()
        assert doc["status"] == "ready", doc
        assert 27_000 <= doc["tokens"] <= 33_000, doc["tokens"]
    read = time.monotonic()

    client = openai.OpenAI(base_url=server.api_base, api_key=API_KEY, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    messages: list[dict[str, str]] = []
    answers = []
    for question, expected in QUESTIONS:
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=16,
            extra_body={"session_id": session["id"]},
        )
        answer = reply.choices[0].message.content or ""
        answers.append(answer)
        assert expected.lower() in answer.lower(), (question, answer, answers)
        assert reply.usage.prompt_tokens <= MAX_APPENDED_PROMPT_TOKENS, reply.usage
        messages.append({"role": "assistant", "content": answer})
    print(f"read {doc['tokens']} tokens in {read - started:.0f} s, "
          f"four answers in {time.monotonic() - read:.0f} s: {answers}")
