"""Request checks shared by chat and completions: the served model, the limits that depend on
the server's settings, and the sampling knobs both requests carry."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from engine.protocol import EngineClient, SamplingParams, StructuredOutput, TooManyTokens
from server.errors import APIError, invalid_request, model_not_found
from server.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat
from server.serving.schemas import bounded_numbers
from server.settings import ServerSettings


def check_model(engine: EngineClient, model: str) -> str:
    """The served model's id, or one of its answer adapters' ("<id>:<name>"); else a 404."""
    if model != engine.model.id and model not in engine.model.adapters:
        raise model_not_found(model)
    return model


def adapter_of(engine: EngineClient, model: str) -> str | None:
    """The adapter a checked model id names, or None for the base model."""
    return None if model == engine.model.id else model


def stop_sequences(settings: ServerSettings, stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop)
    stops = [s for s in stops if s]
    if len(stops) > settings.max_stop_sequences:
        raise invalid_request(
            f"At most {settings.max_stop_sequences} stop sequences are allowed.", param="stop"
        )
    return tuple(stops)


def check_max_tokens(settings: ServerSettings, value: int | None, param: str) -> int:
    if value is None:
        return settings.max_tokens_limit
    if value > settings.max_tokens_limit:
        raise invalid_request(
            f"{param} must be at most {settings.max_tokens_limit}, got {value}.", param=param
        )
    return value


def check_n(settings: ServerSettings, n: int | None) -> int:
    n = 1 if n is None else n
    if n > settings.max_n:
        raise invalid_request(f"n must be at most {settings.max_n}, got {n}.", param="n")
    return n


def check_prompt_tokens(settings: ServerSettings, tokens: int, param: str) -> None:
    """Refuse prompts past max_prompt_tokens (counted after the chat template, with the tools
    it renders)."""
    limit = settings.max_prompt_tokens
    if tokens > limit:
        raise prompt_too_long(f"The prompt has {tokens} tokens", limit, param)


def prompt_too_long(counted: str, limit: int, param: str) -> APIError:
    return APIError(
        400,
        f"{counted}; this server accepts at most {limit}.",
        param=param,
        code="context_length_exceeded",
    )


@contextlib.contextmanager
def counted_within(settings: ServerSettings, param: str) -> Iterator[int]:
    """The token limit to hand the engine's tokenization (it stops there, TooManyTokens), that
    exception as the 400 naming `param`."""
    try:
        yield settings.max_prompt_tokens
    except TooManyTokens as exc:
        raise prompt_too_long(
            f"The prompt has more than {exc.limit} tokens", exc.limit, param
        ) from None


def top_k_of(top_k: int | None) -> int:
    return 0 if top_k is None or top_k < 0 else top_k  # vLLM spells "no cut" as -1


def sampling_params(
    settings: ServerSettings,
    request: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int,
    logprobs: bool,
    top_logprobs: int,
) -> SamplingParams:
    """The sampling knobs chat and completions share; the stop list is checked here."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=top_k_of(request.top_k),
        seed=request.seed,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        stop=stop_sequences(settings, request.stop),
        ignore_eos=bool(request.ignore_eos),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        response_format=response_format(settings, request.response_format),
    )


def response_format(
    settings: ServerSettings, fmt: ResponseFormat | None
) -> StructuredOutput | None:
    """The engine's structured output for a request's response_format (None: free text). The
    engine refuses a schema it cannot enforce; its size is bounded here."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object")
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise invalid_request(
            "response_format json_schema needs json_schema.schema.", param="response_format"
        )
    schema = json.dumps(fmt.json_schema.json_schema, separators=(",", ":"))
    if len(schema.encode()) > settings.max_schema_bytes:
        raise invalid_request(
            f"response_format: the JSON schema is over {settings.max_schema_bytes} bytes.",
            param="response_format",
        )
    # keys in the client's order: llguidance writes properties in it
    bounded = bounded_numbers(fmt.json_schema.json_schema)
    return StructuredOutput("json_schema", json.dumps(bounded, separators=(",", ":")))
