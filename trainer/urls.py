"""Job pages. lightning_site/urls.py mounts `build(workers=...)`, handing in how to list live
workers per queue (a runners read), so trainer never imports runners."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.urls import URLPattern, path

from trainer import views

app_name = "trainer"


def build(*, workers: Callable[[], Any] | None = None) -> list[URLPattern]:
    return [
        path("", views.job_list, name="job_list"),
        path("<int:pk>/", views.job_detail, {"workers": workers}, name="job_detail"),
        path("<int:pk>/cancel/", views.job_cancel, name="job_cancel"),
        path("<int:pk>/resume/", views.job_resume, name="job_resume"),
    ]


urlpatterns = build()
