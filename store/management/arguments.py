"""What the store's management commands share when reading their arguments."""

from __future__ import annotations

from django.core.management.base import CommandError

from store.models import Project


def project_named(name: str) -> Project:
    """The project called `name`, or a CommandError saying there is none."""
    project = Project.objects.filter(name=name).first()
    if project is None:
        raise CommandError(f"no project named {name!r}")
    return project
