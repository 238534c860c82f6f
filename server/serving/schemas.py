"""JSON schemas made safe to enforce on a small model (docs/decisions/064).

A number the schema leaves unbounded lets a model that starts writing digits write them until
max_tokens ("population": 211220000000...). So, where a schema gives no bound of its own:
integers stay within JavaScript's safe integers (what every JSON parser reads exactly), numbers
within +-1e15 with at most 9 decimals. Properties keep the schema's order (llguidance generates
them in that order, as OpenAI's strict mode does): nothing here reorders keys.
"""

from __future__ import annotations

from typing import Any

SAFE_INTEGER = 2**53 - 1  # Number.MAX_SAFE_INTEGER
NUMBER_LIMIT = 1e15  # below 2**53: every integer part here is exact in a double
NUMBER_STEP = 1e-9  # at most 9 decimals
_DATA = frozenset({"const", "enum", "default", "examples"})  # values, not schemas


def bounded_numbers(schema: Any) -> Any:
    """A copy of schema where every integer or number without a bound gets the one above."""
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA else bounded_numbers(value) for key, value in schema.items()}
    kinds = out.get("type")  # a dict where "type" names a property
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    kinds = {k for k in kinds if isinstance(k, str)}
    if kinds & {"integer", "number"}:
        limit = SAFE_INTEGER if "number" not in kinds else NUMBER_LIMIT
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -limit
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = limit
        if "number" in kinds and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
    return out
