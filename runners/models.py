"""The worker registry: every Celery worker process tree, what it serves and what it has."""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class CeleryWorker(models.Model):
    class Status(models.TextChoices):
        ALIVE = "alive"
        LOST = "lost"  # stopped heartbeating without saying goodbye
        STOPPED = "stopped"  # shut down cleanly

    # Celery's node name (`rollouts@host`): unique among running workers; a restart takes it over.
    name = models.CharField(max_length=200, unique=True)
    hostname = models.CharField(max_length=200)
    pid = models.PositiveIntegerField()
    queues = models.JSONField(default=list)
    concurrency = models.PositiveIntegerField(default=1)
    cpu_count = models.PositiveIntegerField(default=1)
    # [{"index": 0, "name": "NVIDIA H100", "total_memory": bytes}, ...]; empty without CUDA.
    cuda_devices = models.JSONField(default=list, blank=True)
    versions = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ALIVE)
    started_at = models.DateTimeField()
    last_heartbeat = models.DateTimeField()
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # workers_mark_lost: alive workers by heartbeat age
            models.Index(fields=["last_heartbeat"], name="celeryworker_alive",
                         condition=Q(status="alive")),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def cuda_memory(self) -> int:
        return sum(d.get("total_memory", 0) for d in self.cuda_devices or [])


class HeldSlot(models.Model):
    """A worker slot still running an agent whose attempt the store already ended (timeout,
    unresponsive, cancelled). The executor marks it each heartbeat while the agent runs on and
    removes it when the agent returns or its pool process exits (runners/stopping.py); a row
    not seen for a while belongs to a process that died, and the reconcile removes it."""

    rollout_id = models.CharField(max_length=64)
    attempt_id = models.CharField(max_length=64)
    project_id = models.BigIntegerField()
    worker_id = models.CharField(max_length=200)
    attempt_status = models.CharField(max_length=16)
    since = models.DateTimeField()
    seen = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["rollout_id", "attempt_id"], name="heldslot_attempt"),
        ]
        indexes = [models.Index(fields=["seen"], name="heldslot_seen")]

    def __str__(self) -> str:
        return f"{self.rollout_id}/{self.attempt_id} on {self.worker_id}"
