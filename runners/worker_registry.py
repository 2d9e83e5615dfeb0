"""Celery worker bootsteps: register the worker when it starts, heartbeat on a timer, say
goodbye when it stops; send what is owed when the broker connection comes back. Added to
every worker by runners.apps.RunnersConfig.ready()."""

from __future__ import annotations

import logging
import os
import socket
import threading

from celery import bootsteps
from django.conf import settings
from django.db import close_old_connections, connections

from core import control
from runners import hardware, services

log = logging.getLogger(__name__)


class WorkerRegistryStep(bootsteps.StartStopStep):
    requires = {"celery.worker.components:Timer"}

    def __init__(self, worker, **kwargs) -> None:
        super().__init__(worker, **kwargs)
        self.tref = None
        self.pid = os.getpid()

    def start(self, worker) -> None:
        queues = worker.app.amqp.queues
        served = sorted(queues.consume_from or queues)
        self._safely(
            services.celery_worker_register, name=worker.hostname, hostname=socket.gethostname(),
            pid=self.pid, queues=served, concurrency=worker.concurrency or 1,
            hardware=hardware.describe(),
        )
        # Attempts held by dead processes of this node (the worker was killed and restarted).
        self._safely(control.run_takeovers, node=worker.hostname, pid=self.pid)
        self.tref = worker.timer.call_repeatedly(
            settings.WORKERS_HEARTBEAT_SECONDS, self._heartbeat, (worker.hostname,)
        )

    def stop(self, worker) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None
        self._safely(services.celery_worker_stop, name=worker.hostname, pid=self.pid)

    def _heartbeat(self, name: str) -> None:
        self._safely(services.celery_worker_heartbeat, name=name, pid=self.pid)

    @staticmethod
    def _safely(fn, **kwargs) -> None:
        # The registry is bookkeeping: a database hiccup must not take the worker down.
        try:
            close_old_connections()
            fn(**kwargs)
        except Exception:
            log.exception("worker registry: %s failed", fn.__name__)


class ResendOnReconnectStep(bootsteps.StartStopStep):
    """A consumer bootstep: when the worker's connection to the broker comes back after it was
    lost (an outage), the messages owed meanwhile (rollouts and training steps whose send the
    broker refused) are sent at once, instead of at the next reconcile (every
    LIGHTNING_RECONCILE_SECONDS, once beat and a control worker are back too). Every worker
    does it; concurrent ones each send what they win (compare-and-swap), in a thread, so the
    consumer starts consuming meanwhile."""

    requires = {"celery.worker.consumer.connection:Connection"}

    def __init__(self, consumer, **kwargs) -> None:
        super().__init__(consumer, **kwargs)
        self.connected_before = False

    def start(self, consumer) -> None:
        if self.connected_before:
            threading.Thread(target=self._resend, name="resend-on-reconnect",
                             daemon=True).start()
        self.connected_before = True

    @staticmethod
    def _resend() -> None:
        try:
            close_old_connections()
            log.info("broker connection back: sending what is owed %s",
                     services.control_resend_owed())
        except Exception:
            log.exception("broker connection back: sending what is owed failed")
        finally:
            connections.close_all()
