from django.core.management.base import BaseCommand, CommandError

from store import services
from store.errors import StoreError
from store.models import ApiKey


class Command(BaseCommand):
    help = "Create a project, optionally with API keys (each key is printed once)."

    def add_arguments(self, parser):
        parser.add_argument("name", help="the new project's name (a slug)")
        parser.add_argument("--description", default="", help="free text")
        parser.add_argument(
            "--key", action="append", default=[], choices=ApiKey.Role.values,
            help="create a key with this role (repeatable)",
        )

    def handle(self, *args, name, description, key, **options):
        try:
            project = services.project_create(name=name, description=description)
        except StoreError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"project {project.name} created")
        for role in key:
            _, raw = services.api_key_create(project=project, role=role)
            self.stdout.write(f"{role} key (shown once): {raw}")
