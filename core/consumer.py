"""The Celery worker's consumer, reconnecting to the broker sooner after an outage.

Celery's consumer waits kombu's default intervals between reconnection tries (2, 4, 6, ... up
to 30 s), so a worker came back up to 8 s after a 16 s broker outage ended, and up to 30 s
after a longer one; these tries are 0.5 s apart at first, then every 2 s (one TCP connect
each: nothing a broker notices). Set as `CELERY_WORKER_CONSUMER`."""

from __future__ import annotations

from celery.worker.consumer import Consumer as CeleryConsumer

RECONNECT = {"interval_start": 0.5, "interval_step": 0.5, "interval_max": 2.0}


class Consumer(CeleryConsumer):
    def ensure_connected(self, conn):  # noqa: ANN001, ANN201 - Celery's signature
        ensure = conn.ensure_connection

        def sooner(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return ensure(*args, **{**RECONNECT, **kwargs})

        conn.ensure_connection = sooner
        return super().ensure_connected(conn)
