"""Site-wide pages: the landing page at `/` (links, and live counts for staff)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db.models import Count
from django.shortcuts import render

from runners.selectors import queue_states
from store.models import Project, Rollout
from trainer.models import TrainingJob


def _by_status(queryset) -> list[tuple[str, int]]:
    rows = queryset.values_list("status").annotate(n=Count("pk")).order_by("status")
    return [(status, n) for status, n in rows]


def site_counts() -> dict[str, Any]:
    """Three grouped counts and the worker registry: bounded work for any store size."""
    return {
        "rollouts": _by_status(Rollout.objects.all()),
        "jobs": _by_status(TrainingJob.objects.all()),
        "queues": queue_states(),
        "projects": Project.objects.count(),
    }


def home(request):
    staff = request.user.is_authenticated and request.user.is_staff
    context = {"flower_url": settings.FLOWER_URL, "counts": site_counts() if staff else None}
    return render(request, "home.html", context)
