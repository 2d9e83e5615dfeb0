"""A Celery worker bootstep: register the worker when it starts, heartbeat on a timer, say
goodbye when it stops. Added to every worker by runners.apps.RunnersConfig.ready()."""

from __future__ import annotations

import logging
import os
import socket

from celery import bootsteps
from django.conf import settings
from django.db import close_old_connections

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
