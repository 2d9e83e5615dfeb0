"""`manage.py train_cancel JOB`: cancel a job, its open step and its unfinished rollouts."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from trainer import services
from trainer.management.commands.train import job_or_error


class Command(BaseCommand):
    help = "Cancel a training job."

    def add_arguments(self, parser) -> None:
        parser.add_argument("job", type=int, help="the job's id (train_list shows them)")

    def handle(self, *args, **opts) -> None:
        job = services.job_cancel(job_id=job_or_error(opts["job"]).pk)
        self.stdout.write(f"job {job.pk}: {job.status}")
