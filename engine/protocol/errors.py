"""The errors the engine raises across the boundary; the server maps each to one OpenAI-shaped
HTTP error (server/errors.py)."""

from __future__ import annotations

from memory_store import errors as store_errors


class EngineError(Exception):
    """Base of every error the engine raises across the boundary."""


class InvalidRequest(EngineError):
    """Bad input the server could not see (unknown strategy knob, bad stop list...). -> 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLong(InvalidRequest):
    """The prompt exceeds what the engine accepts (window, or the memory hard cap). -> 400."""


class TooManyTokens(PromptTooLong):
    """A prompt past the caller's token limit, its encoding stopped there: `at_least` tokens
    counted so far (the caller names the parameter)."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"The prompt has more than {limit} tokens ({at_least} counted).")
        self.at_least = at_least
        self.limit = limit


class EngineOverloaded(EngineError):
    """The waiting queue is full. -> 429 with Retry-After."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class MemoryBudgetExceeded(EngineError):
    """A request on a session would take its tenant past the memory budget. -> 429."""

    def __init__(self, message: str, needed: int, room: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.room = room


class SessionNotFound(EngineError):
    """The engine holds no memory for this session id. -> 404."""


class CollectionNotFound(EngineError):
    """No collection of that name in the memory store. -> 404."""


class CollectionIncompatible(EngineError):
    """The collection cannot join this session: encoded with another model or memory
    configuration (its fingerprint differs), or the session's strategy keeps no encodings. -> 409."""


class EngineDead(EngineError):
    """A fatal error stopped the worker; /ready fails until the process restarts. -> 503."""


class StoreUnavailableError(EngineError, store_errors.StoreUnavailableError):
    """The memory service could not be reached or failed while a document was ingested. The
    session still holds the document in memory, but its encodings are not (all) durable. -> 503."""
