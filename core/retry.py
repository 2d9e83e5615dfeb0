"""One retry policy for talking to the store: the in-process gateway (database errors), the
HTTP client (network errors, 5xx/408/429 answers) and the trainer's train-step task (its
writes after a step has trained) back off the same way.

Transient database errors are the ones a retry can cure: the connection was lost (Postgres
restarting), a deadlock or serialization failure rolled our transaction back, a lock wait
timed out. Every store write a runner makes is safe to repeat (claims are compare-and-swap,
spans are keyed by (attempt, span_id), finishing is idempotent per final status), so a retry
never duplicates work; without one, a single lost connection while finishing recorded a
succeeded agent as failed (issue 13, finding 2). The trainer's finishing write is a
compare-and-swap on the step's try, so repeating it is as safe; without a retry, Postgres
restarting while a step trained left the step to its 120 s lease.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from django.db import InterfaceError, OperationalError, connections

log = logging.getLogger(__name__)

T = TypeVar("T")

# Django wraps psycopg's errors: a lost connection, a deadlock, a serialization failure and a
# lock timeout all arrive as OperationalError; a closed connection as InterfaceError.
TRANSIENT_DB_ERRORS = (OperationalError, InterfaceError)


@dataclass(frozen=True)
class RetryPolicy:
    """`retries` more tries after the first, `backoff` seconds before the first retry,
    doubling up to `backoff_max`. The defaults ride out about 30 s of outage, which covers a
    Postgres restart or a broker failover."""

    retries: int = 10
    backoff: float = 0.2
    backoff_max: float = 5.0

    def delays(self) -> Iterator[float]:
        """The pause before each retry (`retries` of them)."""
        delay = self.backoff
        for _ in range(self.retries):
            yield delay
            delay = min(delay * 2, self.backoff_max)

    def call(self, fn: Callable[[], T], *, what: str) -> T:
        """Run `fn`, retrying transient database errors; the last error is raised."""
        for delay in self.delays():
            try:
                return fn()
            except TRANSIENT_DB_ERRORS as exc:
                log.warning("%s: %s; retrying in %.1fs", what, _first_line(exc), delay)
                _drop_broken_connections()
            time.sleep(delay)
        return fn()


DEFAULT = RetryPolicy()


def _drop_broken_connections() -> None:
    """A connection that failed is closed, so that the next try opens a fresh one."""
    for conn in connections.all(initialized_only=True):
        if conn.in_atomic_block:
            continue  # the caller's transaction is lost anyway; it must retry as a whole
        conn.close_if_unusable_or_obsolete()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
