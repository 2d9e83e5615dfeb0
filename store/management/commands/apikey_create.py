from django.core.management.base import BaseCommand

from store import services
from store.management.arguments import project_named
from store.models import ApiKey


class Command(BaseCommand):
    help = "Create an API key for a project; the key is printed once and stored hashed."

    def add_arguments(self, parser):
        parser.add_argument("project", help="the project's name")
        parser.add_argument("--role", required=True, choices=ApiKey.Role.values,
                            help="what the key may do (README \"Keys and roles\")")
        parser.add_argument("--name", default="", help="a label for the key (default: the role)")

    def handle(self, *args, project, role, name, **options):
        found = project_named(project)
        _, raw = services.api_key_create(project=found, role=role, name=name)
        self.stdout.write(raw)
