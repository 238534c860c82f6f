"""Bounded retries with exponential backoff, shared by the Redis backend and the HTTP client."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from memory_store.errors import StoreUnavailableError

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff for transient connection failures."""

    attempts: int = 4
    base_delay_s: float = 0.05
    max_delay_s: float = 1.0

    def delay(self, attempt: int) -> float:
        return float(min(self.max_delay_s, self.base_delay_s * (2**attempt)))


async def retrying(
    call: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    transient: tuple[type[BaseException], ...],
    what: str,
) -> T:
    """Run `call`, retrying `transient` errors; after the last attempt raise StoreUnavailableError."""
    for attempt in range(policy.attempts):
        try:
            return await call()
        except transient as e:
            if attempt + 1 >= policy.attempts:
                raise StoreUnavailableError(
                    f"{what}: unreachable after {policy.attempts} tries: {e}"
                ) from e
            logger.debug("%s failed (%s); retry %d", what, e, attempt + 1)
            await asyncio.sleep(policy.delay(attempt))
    raise AssertionError("unreachable")
