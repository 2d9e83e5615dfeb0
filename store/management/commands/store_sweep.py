import json

from django.core.management.base import BaseCommand

from store import watchdog


class Command(BaseCommand):
    help = ("Run one watchdog sweep now and print what it changed "
            "(celery-beat runs it on a schedule).")

    def handle(self, *args, **options):
        result = watchdog.sweep()
        self.stdout.write(json.dumps({k: len(v) for k, v in result.as_dict().items()}))
