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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_site.celery import app as celery_app

log = logging.getLogger(__name__)

# Kombu's own retry of one publish: short, because the reconcile is the real retry.
PUBLISH_RETRY = {"max_retries": 2, "interval_start": 0.1, "interval_step": 0.4,
                 "interval_max": 1.0}


@dataclass(frozen=True)
class Message:
    task: str
    kwargs: dict[str, Any]
    queue: str


def publish(messages: Sequence[Message]) -> list[Message]:
    """Send the messages in order over one broker connection; returns those not sent (the
    first failure and everything after it)."""
    sent = 0
    if not messages:
        return []
    try:
        with celery_app.producer_or_acquire() as producer:
            for message in messages:
                celery_app.send_task(message.task, kwargs=message.kwargs, queue=message.queue,
                                     producer=producer, retry=True, retry_policy=PUBLISH_RETRY)
                sent += 1
    except Exception as exc:  # the broker is down or refused: the rows say what is owed
        log.warning("published %d of %d messages; the rest wait for the next reconcile: %r",
                    sent, len(messages), exc)
    return list(messages[sent:])
