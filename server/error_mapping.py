"""Every exception (ours, the engine's, the memory store's, pydantic's, starlette's) mapped to
an APIError (server/errors.py), and the app's handlers that answer it in OpenAI's shape.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.protocol import (
    CollectionIncompatible,
    CollectionNotFound,
    EngineDead,
    EngineError,
    EngineOverloaded,
    InvalidRequest,
    MemoryBudgetExceeded,
    SessionNotFound,
)
from memory_store.errors import StoreError, StoreFull, StoreUnavailableError
from server.errors import (
    STORE_RETRY_AFTER_SECONDS,
    APIError,
    error_response,
    invalid_request,
    limit_reached,
    memory_store_unavailable,
)

logger = logging.getLogger(__name__)


def from_exception(exc: BaseException) -> APIError:
    """Map any exception (ours, the engine's, pydantic's) to an APIError."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError | ValidationError):
        return _from_validation_errors(exc.errors())
    if isinstance(exc, InvalidRequest):  # PromptTooLong included
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, EngineOverloaded):
        retry_after = str(max(1, math.ceil(exc.retry_after)))
        return APIError(
            429,
            str(exc) or "The server is overloaded; retry later.",
            code="overloaded",
            headers={"Retry-After": retry_after},
        )
    if isinstance(exc, MemoryBudgetExceeded):
        return limit_reached("memory_limit", f"{str(exc).capitalize()}; delete a session first.")
    if isinstance(exc, SessionNotFound):
        return APIError(
            404, str(exc) or "Session not found.", param="session_id", code="session_not_found"
        )
    if isinstance(exc, CollectionNotFound):
        return APIError(
            404, str(exc) or "Collection not found.", param="name", code="collection_not_found"
        )
    if isinstance(exc, CollectionIncompatible):
        return APIError(409, str(exc), param="name", code="collection_incompatible")
    if isinstance(exc, EngineDead):
        logger.error("engine dead: %r", exc)
        return APIError(503, "The engine is not available.", code="engine_dead")
    if isinstance(exc, StoreFull):  # Redis at maxmemory (noeviction): nothing was written
        logger.error("memory store full: %s", exc)
        return APIError(
            503,
            "The memory store is full; retry later or delete sessions you no longer need.",
            code="memory_store_full",
            headers={"Retry-After": str(STORE_RETRY_AFTER_SECONDS)},
        )
    if isinstance(exc, StoreUnavailableError):
        logger.warning("memory store unavailable: %s", exc)
        return memory_store_unavailable()
    if isinstance(exc, StoreError):
        return internal_error(exc, "memory store error", code="memory_store_error")
    return internal_error(
        exc, "engine error" if isinstance(exc, EngineError) else "unexpected error"
    )


def internal_error(exc: BaseException, what: str, code: str | None = None) -> APIError:
    """A 500 that says only "internal error" and an id; the exception goes to the log under
    that id (never to the client: it may carry paths, errno or another tenant's data)."""
    error_id = f"err_{secrets.token_hex(8)}"
    logger.error("%s %s: %r", error_id, what, exc, exc_info=exc)
    return APIError(500, f"Internal error (request id {error_id}).", code=code)


_TYPE_TAGS = {
    "str",
    "int",
    "float",
    "bool",
    "list",
    "dict",
    "none",
    "function-after",
    "function-before",
    "function-wrap",
    "literal",
    "union",
    "tagged-union",
}


def _param_from_loc(loc: Sequence[int | str]) -> str | None:
    """("body", "messages", 0, "content", "str") -> "messages[0].content"."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path") else loc)
    param = ""
    for part in parts:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            param += f".{part}" if param else part
        else:
            break  # a pydantic union tag ("list[str]", "function-after[...]"): stop here
    return param or None


def _from_validation_errors(errors: Sequence[Any]) -> APIError:
    if not errors:
        return invalid_request("Invalid request.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error")
        detail = f" ({reason})" if reason and reason != "Expecting value" else ""
        return invalid_request(f"The request body is not valid JSON{detail}.")
    loc = first.get("loc", ())
    param = _param_from_loc(loc)
    if param is None and tuple(loc) in (("body",), ()):
        # The body as a whole: missing, or not an object (a list, a string, null...).
        return invalid_request("The request body must be a JSON object.")
    if first.get("type") == "missing":
        message = f"Missing required parameter: '{param}'."
    else:
        message = f"Invalid value for '{param}': {first.get('msg', 'invalid')}."
    return invalid_request(message, param=param)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    return error_response(from_exception(exc))


async def _handle_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"Unknown route: {request.method} {request.url.path}"
    else:
        message = str(exc.detail)
    headers = dict(exc.headers) if exc.headers else None
    return error_response(APIError(exc.status_code, message, headers=headers))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _handle)
    app.add_exception_handler(ValidationError, _handle)
    app.add_exception_handler(APIError, _handle)
    app.add_exception_handler(EngineError, _handle)
    app.add_exception_handler(StoreError, _handle)
    app.add_exception_handler(StarletteHTTPException, _handle_http)
    app.add_exception_handler(Exception, _handle)
