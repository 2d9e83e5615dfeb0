from __future__ import annotations

from django.apps import AppConfig


class RunnersConfig(AppConfig):
    name = "runners"
    default_auto_field = "django.db.models.BigAutoField"
