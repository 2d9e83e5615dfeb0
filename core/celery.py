"""The Celery app, configured from Django settings (the `CELERY_*` names in settings.py).

Workers: `celery -A lightning_site worker -Q rollouts` (see README "Distributed").
"""

from __future__ import annotations

import logging
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")

app = Celery("lightning_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Finds `tasks.py` in every installed app (runners.tasks, trainer.tasks, ...).
app.autodiscover_tasks()


# The control queue's routine tasks run every few seconds: their "received" and "succeeded"
# lines (about 1,400 an hour) are DEBUG, not INFO. Their failures still log as errors.
ROUTINE_TASKS = frozenset({"runners.sweep", "runners.reconcile"})


class RoutineTasksAtDebug(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if (record.levelno == logging.INFO and isinstance(args, dict)
                and args.get("name") in ROUTINE_TASKS):
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


for _name in ("celery.app.trace", "celery.worker.strategy"):
    logging.getLogger(_name).addFilter(RoutineTasksAtDebug())
