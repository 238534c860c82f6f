"""The one place where every error becomes OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.
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
from server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_HTTP_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the server raises itself; carries everything the response needs."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or _HTTP_ERROR_TYPES.get(status_code, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def response_not_found(response_id: str) -> APIError:
    """An unknown stored response, or another tenant's (the same answer)."""
    return APIError(
        404,
        f"No response found with id '{response_id}'.",
        param="response_id",
        code="response_not_found",
    )


def invalid_api_key(message: str) -> APIError:
    return APIError(
        401,
        message,
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body exceeds {limit} bytes.", code="request_too_large")


def headers_too_large(limit: int) -> APIError:
    return APIError(
        431,
        f"The request's path, query and headers exceed {limit} bytes.",
        code="request_header_fields_too_large",
        headers={"Connection": "close"},
    )


def unsupported_content_encoding(encoding: str) -> APIError:
    return APIError(
        415,
        f"Content-Encoding '{encoding}' is not accepted; send the request body uncompressed.",
        code="unsupported_content_encoding",
    )


# Seconds a client is told to wait before retrying on another instance while this one drains.
DRAIN_RETRY_AFTER_SECONDS = 1


def server_shutting_down() -> APIError:
    """A new request while the server drains: 503, and the connection is closed so that the
    client's retry opens a new one (to another instance, behind a load balancer)."""
    return APIError(
        503,
        "The server is shutting down; retry the request.",
        code="server_shutting_down",
        headers={"Retry-After": str(DRAIN_RETRY_AFTER_SECONDS), "Connection": "close"},
    )


# Seconds a client is told to wait when the memory service cannot be reached.
STORE_RETRY_AFTER_SECONDS = 2


def memory_store_unavailable(detail: str = "") -> APIError:
    """An operation that must be durable (create a session, upload a document, restore a
    session this replica does not hold) while the memory service is down: 503, retry later.
    Sessions this replica holds keep serving chat meanwhile."""
    message = "The memory store is unavailable; retry the request shortly."
    return APIError(
        503,
        f"{message} ({detail})" if detail else message,
        code="memory_store_unavailable",
        headers={"Retry-After": str(STORE_RETRY_AFTER_SECONDS)},
    )


# --- sessions and documents ---------------------------------------------------------------------


def session_not_found(session_id: str) -> APIError:
    # Also the answer for another tenant's session: its existence is not revealed (never 403).
    return APIError(
        404,
        f"No session found with id '{session_id}'.",
        param="session_id",
        code="session_not_found",
    )


def document_not_found(document_id: str) -> APIError:
    return APIError(
        404,
        f"No document found with id '{document_id}'.",
        param="document_id",
        code="document_not_found",
    )


def collection_not_found(name: str) -> APIError:
    return APIError(
        404, f"No collection found with name '{name}'.", param="name", code="collection_not_found"
    )


def session_busy(message: str) -> APIError:
    return APIError(409, message, param="session_id", code="session_busy")


def session_conflict(session_id: str) -> APIError:
    """A turn answered on a copy of the session another replica had moved past: 409."""
    return APIError(
        409,
        f"Session '{session_id}' changed on another replica while this answer was made; the "
        "answer was not kept. Retry: the request will read the session as it is now.",
        param="session_id",
        code="session_conflict",
    )


def limit_reached(code: str, message: str) -> APIError:
    """A per-tenant quota (session_limit, document_limit, memory_limit...): 429, no Retry-After,
    since waiting alone does not free it."""
    return APIError(429, message, code=code)


def unsupported_media_type(message: str) -> APIError:
    return APIError(415, message, param="file", code="unsupported_media_type")


def invalid_encoding(message: str) -> APIError:
    return APIError(400, message, param="file", code="invalid_encoding")


def empty_document(message: str = "The document contains no text.") -> APIError:
    return APIError(400, message, param="file", code="empty_document")


def invalid_document(message: str) -> APIError:
    return APIError(400, message, param="file", code="invalid_document")


def document_too_large(message: str) -> APIError:
    return APIError(413, message, param="file", code="document_too_large")


def document_extraction_timeout(seconds: float) -> APIError:
    """Reading the upload passed its time limit; its worker process was killed."""
    message = f"Reading the document took longer than {seconds:g} seconds; it was stopped."
    return APIError(422, message, param="file", code="document_extraction_timeout")


def document_extraction_busy(own_share: bool, retry_after: int) -> APIError:
    """No extraction slot came free in time: 429 when the key holds its own share of them,
    503 when other keys hold them all."""
    if own_share:
        message = "This API key is already reading as many documents as it may; retry shortly."
        status = 429
    else:
        message = "The server is reading other documents; retry shortly."
        status = 503
    headers = {"Retry-After": str(retry_after)}
    return APIError(status, message, code="document_extraction_busy", headers=headers)


_STATUS_DESCRIPTIONS = {
    400: "Invalid request (body, parameter, or a limit such as n or max_tokens).",
    401: "Missing or incorrect API key.",
    404: "Unknown model, session, document or collection (another tenant's session included).",
    409: "The session is still reading documents (session_busy), or the collection was encoded "
    "for another model or memory configuration (collection_incompatible).",
    413: "The request body, or the document in it, is too large.",
    415: "Unsupported media type or Content-Encoding.",
    422: "Reading the document passed its time limit (document_extraction_timeout).",
    429: "Overloaded (with Retry-After), or a per-key quota is reached.",
    431: "The request's path, query and headers are too large.",
    500: "The engine failed.",
    503: "The engine or the memory store is not available, or the server is shutting down "
    "(with Retry-After).",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the errors a route can answer, each in OpenAI's error shape."""
    return {
        status: {"model": ErrorResponse, "description": _STATUS_DESCRIPTIONS[status]}
        for status in statuses
    }


def error_body(error: APIError) -> dict[str, Any]:
    info = ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.code)
    return ErrorResponse(error=info).model_dump()


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status_code, headers=error.headers)


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
