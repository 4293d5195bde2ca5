"""Failover policy for one request: which failures move on to another backend, how many times,
until when, and the retry budget shared by every request of this process.

Retries are driven by tenacity (the first attempt runs bare, see `Failover.run`). The proxy
raises its own "retry elsewhere" exception only before any byte reached the client, so a started
stream is never replayed. A retry is refused when retries still waiting for an answer are
`budget_percent` of the requests in flight (at least `min_retries` may always run): a fleet that
is failing gets its normal load, not load x attempts.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    stop_any,
    wait_none,
)
from tenacity.stop import stop_base

from router.core.settings import RetryConfig

T = TypeVar("T")


class RetryBudget:
    """Retries count from their start until their response starts (or they fail): a retry that
    is streaming an answer is ordinary load again, one still waiting on a backend is not."""

    def __init__(self, percent: float, minimum: int) -> None:
        self.percent = percent
        self.minimum = minimum
        self.active = 0  # retries not yet answered
        self.refused = 0

    def allows(self, in_flight: int) -> bool:
        return self.active < max(self.minimum, in_flight * self.percent / 100)

    def slot(self, is_retry: bool) -> Callable[[], None]:
        """Count one retry; the returned release is idempotent (call it as soon as it's answered
        and again in `finally`)."""
        if not is_retry:
            return _nothing
        self.active += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.active -= 1

        return release


def _nothing() -> None:
    return None


class _BudgetSpent(stop_base):
    """Stop retrying when the process-wide retry budget refuses one more."""

    def __init__(self, may_retry: Callable[[], bool]) -> None:
        self._may_retry = may_retry

    def __call__(self, retry_state: RetryCallState) -> bool:
        return not self._may_retry()


class Failover:
    def __init__(
        self,
        cfg: RetryConfig,
        in_flight: Callable[[], int],
        retry_on: type[BaseException],
    ) -> None:
        self.budget = RetryBudget(cfg.budget_percent, cfg.min_retries)
        self._cfg = cfg
        self._in_flight = in_flight
        self._retry_on = retry_on
        self._retry = retry_if_exception_type(retry_on)

    def _may_retry(self) -> bool:
        if self.budget.allows(self._in_flight()):
            return True
        self.budget.refused += 1
        return False

    async def run(self, attempt: Callable[[int, Callable[[], None]], Awaitable[T]]) -> T:
        """Call `attempt(n, answered)` (n = 1, 2, ...) until it returns, raises something not
        retryable, or the attempts, the deadline or the budget run out (then its last error is
        raised). The attempt calls `answered()` once its response has started."""
        cfg = self._cfg
        started = time.monotonic()
        # The first attempt runs bare: tenacity's machinery costs ~0.1 ms a call, too much to pay
        # on every request for the rare one that fails over.
        try:
            return await attempt(1, _nothing)
        except self._retry_on:
            elapsed = time.monotonic() - started
            if cfg.attempts < 2 or elapsed >= cfg.deadline or not self._may_retry():
                raise
        retrying = AsyncRetrying(
            stop=stop_any(
                stop_after_attempt(cfg.attempts - 1),
                stop_after_delay(cfg.deadline - elapsed),
                _BudgetSpent(self._may_retry),
            ),
            retry=self._retry,
            wait=wait_none(),
            reraise=True,
        )
        number = 1

        async def retry() -> T:
            nonlocal number
            number += 1
            release = self.budget.slot(True)
            try:
                return await attempt(number, release)
            finally:
                release()

        return await retrying(retry)
