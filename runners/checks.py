"""System checks: rules between the runners' settings (`manage.py check` reports them)."""

from __future__ import annotations

from django.conf import settings
from django.core.checks import Error, Warning


def check_settings(app_configs=None, **kwargs) -> list:
    problems = []
    heartbeat = settings.RUNNERS_HEARTBEAT_SECONDS
    unresponsive = settings.RUNNERS_DEFAULT_UNRESPONSIVE_SECONDS
    if unresponsive and unresponsive <= 2 * heartbeat:
        problems.append(Error(
            f"RUNNERS_DEFAULT_UNRESPONSIVE_SECONDS ({unresponsive}) must exceed twice "
            f"RUNNERS_HEARTBEAT_SECONDS ({heartbeat})",
            hint="otherwise healthy attempts are marked unresponsive between two heartbeats",
            id="runners.E001",
        ))
    silent = settings.STORE_SILENT_WORKER_SECONDS
    if silent and silent <= 2 * heartbeat:
        problems.append(Error(
            f"STORE_SILENT_WORKER_SECONDS ({silent}) must exceed twice "
            f"RUNNERS_HEARTBEAT_SECONDS ({heartbeat})",
            hint="a busy pool process shows itself only by its attempt's heartbeat: a claim "
                 "of a live worker would be marked unresponsive before its first heartbeat",
            id="runners.E004",
        ))
    if settings.WORKERS_LOST_AFTER_SECONDS <= 2 * settings.WORKERS_HEARTBEAT_SECONDS:
        problems.append(Error(
            f"WORKERS_LOST_AFTER_SECONDS ({settings.WORKERS_LOST_AFTER_SECONDS}) must exceed "
            f"twice WORKERS_HEARTBEAT_SECONDS ({settings.WORKERS_HEARTBEAT_SECONDS})",
            hint="otherwise live workers are marked lost between two heartbeats",
            id="runners.E002",
        ))
    for queue in ("ROLLOUTS", "TRAINING"):
        low = getattr(settings, f"SCALE_{queue}_MIN_WORKERS")
        high = getattr(settings, f"SCALE_{queue}_MAX_WORKERS")
        if low > high:
            problems.append(Error(
                f"SCALE_{queue}_MIN_WORKERS ({low}) exceeds SCALE_{queue}_MAX_WORKERS ({high})",
                hint="lightning_desired_workers is kept within [MIN, MAX] (README \"Scaling\")",
                id="runners.E003",
            ))
    if settings.CELERY_BROKER_URL.startswith("memory://") and not settings.EMBEDDED_WORKERS:
        problems.append(Warning(
            "CELERY_BROKER_URL is memory:// with DATABASE_URL set: only workers inside the "
            "sending process (core.embedded) will ever see its messages",
            id="runners.W001",
        ))
    return problems
