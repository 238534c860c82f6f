"""The Responses API end to end with the official SDK: text, streaming with typed events, a
second response that needs the first one's document, text.format json_schema, function tools,
GET / DELETE and tenant-scoped ids."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .conftest import API_KEY

pytestmark = pytest.mark.real_model

DOCUMENT = (
    "Harbour log, spring season.\n"
    + "The ferry left at dawn and the gulls followed it past the breakwater. " * 12
    + "\nThe lighthouse keeper this season is named Marta Ilves.\n"
    + "Fishing boats came back before noon with cod and herring. " * 12
)


def test_text_and_a_follow_up_that_needs_the_first_document(client, model_id):
    first = client.responses.create(
        model=model_id,
        instructions="Answer in one short sentence.",
        input=f"{DOCUMENT}\n\nWhat did the fishing boats bring back?",
        temperature=0,
        max_output_tokens=40,
    )
    assert first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert first.output_text and first.output[0].type == "message"
    assert first.usage.input_tokens > 200 and first.usage.output_tokens > 0
    second = client.responses.create(
        model=model_id,
        instructions="Answer in one short sentence.",
        input="Who is the lighthouse keeper this season?",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=40,
    )
    assert second.previous_response_id == first.id
    assert "Marta" in second.output_text  # only the first response's input named her
    assert second.usage.input_tokens > first.usage.input_tokens  # the conversation continued
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_streaming_events(client, model_id):
    events = list(
        client.responses.create(
            model=model_id, input="Say hello.", temperature=0, max_output_tokens=16, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text
    done = client.responses.retrieve(events[-1].response.id)
    assert done.usage.output_tokens == events[-1].response.usage.output_tokens


def test_text_format_json_schema(client, model_id):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = client.responses.create(
        model=model_id,
        input="Invent a person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
        temperature=0,
        max_output_tokens=60,
    )
    value = json.loads(reply.output_text)
    assert set(value) == {"name", "age"}


def test_a_function_call_and_its_output(client, model_id):
    weather = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    reply = client.responses.create(
        model=model_id,
        input="What is the weather in Paris?",
        tools=[weather],
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    [call] = reply.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert "city" in json.loads(call.arguments)
    follow = client.responses.create(
        model=model_id,
        previous_response_id=reply.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}],
        tools=[weather],
        tool_choice="none",
        temperature=0,
        max_output_tokens=30,
    )
    assert follow.output_text


def test_ids_are_tenant_scoped_and_deletable(server, client, model_id):
    reply = client.responses.create(model=model_id, input="Hi.", max_output_tokens=4)
    with httpx.Client(base_url=server.api_base, timeout=30) as http:
        other = http.get(f"/responses/{reply.id}", headers={"Authorization": "Bearer other-key"})
    assert other.status_code in (401, 404)  # another key: unknown tenant or unknown id
    client.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model_id, input="Hi.", previous_response_id=reply.id)
    assert API_KEY
