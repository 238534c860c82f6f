"""Structured outputs end to end: the official SDK's parse helpers and response_format against
a real server with the embedded model; a session whose document has moved to memory answers in
JSON too."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from .conftest import API_KEY, upload_and_wait

pytestmark = pytest.mark.real_model


class City(BaseModel):
    name: str
    country: str
    population: int


PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK_CITY = [{"role": "user", "content": "Describe Paris as JSON: name, country, population."}]


def test_sdk_parse_returns_the_pydantic_model(client, model_id):
    reply = client.chat.completions.parse(
        model=model_id, messages=ASK_CITY, response_format=City, temperature=0, max_tokens=80
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_streamed_json_schema_parses(client, model_id):
    stream = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Invent a person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
        temperature=0.8,
        seed=7,
        max_tokens=80,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_on_completions(server, model_id):
    with httpx.Client(base_url=server.api_base, timeout=120) as http:
        reply = http.post(
            "/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={
                "model": model_id,
                "prompt": "A JSON object describing a cat:",
                "response_format": {"type": "json_object"},
                "max_tokens": 60,
                "temperature": 0,
            },
        ).json()
    choice = reply["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    else:  # cut by max_tokens: an object that had not closed yet
        assert choice["finish_reason"] == "length" and choice["text"].startswith("{")


def test_a_schema_it_cannot_enforce_is_a_400_naming_the_feature(client, model_id):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=model_id,
            messages=ASK_CITY,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            },
        )
    assert refused.value.status_code == 400
    assert "uniqueItems" in refused.value.message
    assert refused.value.body["param"] == "response_format"


def test_a_session_answers_in_json_about_its_document(server, client, model_id):
    facts = "The lighthouse keeper is Marta Ilves. She is 47 years old. " * 3
    filler = "The harbour ledger lists cargo, tides and the weather of each day. " * 120
    session, _ = upload_and_wait(server.api_base, "ledger", filler + facts + filler, 180)
    reply = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Who is the lighthouse keeper, and how old?"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
        temperature=0,
        max_tokens=60,
        extra_body={"session_id": session["id"]},
    )
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
