"""OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, and the errors the
server answers; server/error_mapping.py maps every exception onto one.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from server.protocol import ErrorInfo, ErrorResponse

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
