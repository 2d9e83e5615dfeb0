"""AGL 0.3's process roles, from the environment as AGL reads them.

`AGL_CURRENT_ROLE` is `runner`, `algorithm` or `both` (AGL's default). Here it decides which
in-process workers the embedded default starts (`runner`: rollouts only; `algorithm`: training
only, rollouts being run by runners elsewhere; `both`: both), what `fit()` does (`runner`:
serve rollouts to the store at AGL_SERVER_HOST:AGL_SERVER_PORT, as AGL's runner-only processes
do), and `manage.py runner` refuses to start in an `algorithm` process. AGL_SERVER_HOST and
AGL_SERVER_PORT name the store a runner uses (`runners.remote_runner.default_server`).
"""

from __future__ import annotations

from enum import StrEnum

from django.core.exceptions import ImproperlyConfigured

from core.env import env_str
from core.queues import Queue

ROLE_VARIABLE = "AGL_CURRENT_ROLE"


class Role(StrEnum):
    RUNNER = "runner"
    ALGORITHM = "algorithm"
    BOTH = "both"


def current_role() -> Role:
    raw = (env_str(ROLE_VARIABLE) or Role.BOTH.value).strip().lower()
    try:
        return Role(raw)
    except ValueError:
        raise ImproperlyConfigured(
            f"{ROLE_VARIABLE} must be one of {[r.value for r in Role]}, not {raw!r}"
        ) from None


def runs_rollouts(role: Role) -> bool:
    return role in (Role.RUNNER, Role.BOTH)


def runs_algorithm(role: Role) -> bool:
    return role in (Role.ALGORITHM, Role.BOTH)


def embedded_queues(role: Role) -> tuple[Queue, ...]:
    """The queues the embedded default serves in a process of this role."""
    queues = []
    if runs_rollouts(role):
        queues.append(Queue.ROLLOUTS)
    if runs_algorithm(role):
        queues.append(Queue.TRAINING)
    return tuple(queues)
