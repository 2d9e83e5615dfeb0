"""The one publisher of task messages (rollout tasks, train-step tasks).

A message is a wake-up call; the rows are the truth, and they record that a message is owed
(a rollout's dispatch, a step's `sent_at`). Publishing happens after the commit that owes the
message. When the broker refuses or cannot be reached, the publisher does not hold the caller
up retrying: it reports what it could not send, the caller marks those rows unpublished, and
the next reconcile (every LIGHTNING_RECONCILE_SECONDS) sends them again. A broker outage so
costs seconds after the broker is back, not the age-based re-send (RUNNERS_REDISPATCH_SECONDS),
which remains for messages that were published and then lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from core.celery import app as celery_app

log = logging.getLogger(__name__)

# Kombu's own retry of one publish: short, because the reconcile is the real retry.
PUBLISH_RETRY = {"max_retries": 2, "interval_start": 0.1, "interval_step": 0.4,
                 "interval_max": 1.0}
# With publisher confirms (RabbitMQ, settings), how long one publish waits for the broker's
# confirm before it counts as not sent: a broker that went silent must not hold the sender.
CONFIRM_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class Message:
    task: str
    kwargs: dict[str, Any]
    queue: str


# Send options per task name (e.g. time limits), computed for a batch of that task's messages;
# registered by the app owning the task (runners.apps registers the rollout task's limits).
OptionsFor = Callable[[Sequence[Message]], list[dict[str, Any]]]
_options_for: dict[str, OptionsFor] = {}


def register_options(task: str, options_for: OptionsFor) -> None:
    _options_for[task] = options_for


# What a task's target (the agent a rollout task runs) must be, checked where work is created
# for it: returns why it cannot be used, or None. Registered by the app owning the task
# (runners.apps: the agent loader), so the trainer refuses a job whose agent does not import
# without importing runners.
TargetCheck = Callable[[str], str | None]
_target_checks: dict[str, TargetCheck] = {}


def register_target_check(task: str, check: TargetCheck) -> None:
    _target_checks[task] = check


def target_problem(task: str, target: str) -> str | None:
    """Why `target` cannot be run by `task`'s workers as far as this process can tell; None
    when it can, or when no check is registered for the task."""
    check = _target_checks.get(task)
    return None if check is None else check(target)


def _options(messages: Sequence[Message]) -> list[dict[str, Any]]:
    options: list[dict[str, Any]] = [{} for _ in messages]
    for task, options_for in _options_for.items():
        at = [i for i, message in enumerate(messages) if message.task == task]
        if not at:
            continue
        try:
            for i, extra in zip(at, options_for([messages[i] for i in at]), strict=True):
                options[i] = extra
        except Exception:  # the options are a refinement: the messages go without them
            log.exception("send options for %s could not be computed", task)
    return options


def publish(messages: Sequence[Message]) -> list[Message]:
    """Send the messages in order over one broker connection; returns those not sent (the
    first failure and everything after it)."""
    sent = 0
    if not messages:
        return []
    try:
        options = _options(messages)
        with celery_app.producer_or_acquire() as producer:
            for message, extra in zip(messages, options, strict=True):
                celery_app.send_task(message.task, kwargs=message.kwargs, queue=message.queue,
                                     producer=producer, retry=True, retry_policy=PUBLISH_RETRY,
                                     confirm_timeout=CONFIRM_TIMEOUT_SECONDS, **extra)
                sent += 1
    except Exception as exc:  # the broker is down or refused: the rows say what is owed
        log.warning("published %d of %d messages; the rest wait for the next reconcile: %r",
                    sent, len(messages), exc)
    return list(messages[sent:])
