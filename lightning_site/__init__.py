# Load the Celery app whenever Django starts, so shared_task binds to it (Celery's Django docs).
# `celery -A lightning_site` finds it here as `app`; it lives in the kernel (core/celery.py).
from core.celery import app

celery_app = app

__all__ = ("app", "celery_app")
