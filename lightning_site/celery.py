"""The Celery app, configured from Django settings (the `CELERY_*` names in settings.py).

Workers: `celery -A lightning_site worker -Q rollouts` (see README "Distributed").
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")

app = Celery("lightning_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Finds `tasks.py` in every installed app (runners.tasks, trainer.tasks, ...).
app.autodiscover_tasks()
