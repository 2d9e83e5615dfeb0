"""`manage.py quota_set --project P [--gpu-seconds-per-day N|none]`: set a project's quotas
(README "Quotas"); without a flag it shows them. A quota is a flag in FLAGS: its option, the
keyword of services.project_quota_set and the Project column it sets."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from store import selectors, services
from store.errors import StoreError
from store.management.arguments import project_named

NO_CAP = "none"
# (option, keyword of project_quota_set and Project column, help)
FLAGS = [
    ("--gpu-seconds-per-day", "gpu_seconds_per_day",
     "the cap on the project's ledger GPU-seconds over the last 24 h (rolling): past it its "
     f"training steps wait; '{NO_CAP}' removes it"),
]


def _cap(text: str) -> float | None:
    """A number, or `none` (no cap); services.project_quota_set checks the range."""
    if text.strip().lower() == NO_CAP:
        return None
    try:
        return float(text)
    except ValueError:
        raise CommandError(f"a cap is a number or '{NO_CAP}', got {text!r}") from None


class Command(BaseCommand):
    help = "Set (or show) a project's quotas."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--project", required=True, help="the project's name")
        for option, _, text in FLAGS:
            parser.add_argument(option, help=text)

    def handle(self, *args, project: str, **options) -> None:
        row = project_named(project)
        changes = {name: _cap(options[name]) for _, name, _ in FLAGS
                   if options[name] is not None}
        try:
            row = services.project_quota_set(project=row, **changes)
        except StoreError as exc:
            raise CommandError(str(exc)) from None
        settings = "  ".join(f"{name}={_shown(getattr(row, name))}" for _, name, _ in FLAGS)
        self.stdout.write(f"project {row.name}: {settings}")
        quota = selectors.gpu_quotas(project_ids=[row.pk]).get(row.pk)
        if quota is not None:
            self.stdout.write(quota.describe())


def _shown(value: float | None) -> str:
    return NO_CAP if value is None else f"{value:g}"
