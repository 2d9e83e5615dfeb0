from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from store import services
from store.management.arguments import project_named


class Command(BaseCommand):
    help = ("Delete old resource versions: keeps the last N of each id, versions marked keep, "
            "and every version an unfinished rollout uses.")

    def add_arguments(self, parser):
        parser.add_argument("--keep-last", type=int, default=settings.STORE_RESOURCES_KEEP_LAST,
                            help="versions kept per resources id (STORE_RESOURCES_KEEP_LAST)")
        parser.add_argument("--project", help="only this project")

    def handle(self, *args, keep_last, project, **options):
        scope = None
        if project:
            scope = project_named(project)
        if keep_last < 1:
            raise CommandError("--keep-last must be >= 1")
        deleted = services.resources_retain(keep_last=keep_last, project=scope)
        self.stdout.write(f"deleted {deleted} resource versions")
