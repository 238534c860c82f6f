"""Schemas as the engine receives them (server/serving/schemas.py): the client's property order
kept, numbers without bounds bounded, bounds a schema sets left as they are."""

from __future__ import annotations

import json

from pydantic import BaseModel

from server.protocol import ChatCompletionRequest, ResponseFormat
from server.serving.checks import response_format
from server.serving.schemas import NUMBER_LIMIT, NUMBER_STEP, SAFE_INTEGER, bounded_numbers
from server.serving.tools import plan_tools
from server.settings import ServerSettings


class City(BaseModel):
    name: str
    country: str
    population: int


def test_properties_keep_the_clients_order() -> None:
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema()}}
    )
    out = response_format(ServerSettings(), fmt)
    assert out is not None and out.schema is not None
    schema = json.loads(out.schema)
    assert list(schema["properties"]) == ["name", "country", "population"]
    assert schema["properties"]["population"]["maximum"] == SAFE_INTEGER


def test_unbounded_numbers_get_bounds_everywhere() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "x": {"type": ["number", "null"]},
            "list": {"type": "array", "items": {"type": "integer"}},
            "pick": {"anyOf": [{"type": "number"}, {"type": "string"}]},
            "type": {"type": "integer"},  # a property named "type" is a schema like any other
        },
        "$defs": {"d": {"type": "integer"}},
    }
    out = bounded_numbers(schema)
    props = out["properties"]
    assert props["n"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    assert props["x"]["minimum"] == -NUMBER_LIMIT and props["x"]["multipleOf"] == NUMBER_STEP
    assert props["list"]["items"]["maximum"] == SAFE_INTEGER
    assert props["pick"]["anyOf"][0]["maximum"] == NUMBER_LIMIT
    assert "maximum" not in props["pick"]["anyOf"][1]
    assert props["type"]["maximum"] == SAFE_INTEGER
    assert out["$defs"]["d"]["minimum"] == -SAFE_INTEGER
    assert schema["properties"]["n"] == {"type": "integer"}  # the client's schema untouched


def test_a_schemas_own_bounds_and_data_stay() -> None:
    schema = {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0},
            "p": {"type": "number", "exclusiveMaximum": 1, "multipleOf": 0.5},
        },
        "default": {"type": "integer"},  # a value, not a schema
    }
    props = bounded_numbers(schema)["properties"]
    assert props["age"] == {"type": "integer", "minimum": 0, "maximum": SAFE_INTEGER}
    assert props["p"] == {
        "type": "number",
        "exclusiveMaximum": 1,
        "multipleOf": 0.5,
        "minimum": -NUMBER_LIMIT,
    }
    assert bounded_numbers(schema)["default"] == {"type": "integer"}


def test_tool_arguments_are_bounded_too() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"k": {"type": "integer"}}},
        },
    }
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [tool]}
    )
    plan = plan_tools(ServerSettings(), request, None)
    assert plan is not None and plan.grammar is not None
    assert f'"maximum": {SAFE_INTEGER}' in (plan.grammar.schema or "")
