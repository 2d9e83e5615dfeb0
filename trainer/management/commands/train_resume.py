"""`manage.py train_resume JOB`: go on from the last finished step (after a failure, a
cancel, or every process being stopped), following it with progress."""

from __future__ import annotations

import time

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from core.console import progress_stream, quiet_libraries, sigterm_as_interrupt
from trainer import services
from trainer.management.commands.train import (
    interrupted,
    job_or_error,
    leftover_notice,
    run_followed,
    summary,
)


class Command(BaseCommand):
    help = "Resume a training job from its last finished step."

    def add_arguments(self, parser) -> None:
        parser.add_argument("job", type=int, help="the job's id (train_list shows them)")
        parser.add_argument(
            "--reclaim", action="store_true",
            help="take back work held by workers that are gone now instead of when their "
                 "leases run out (implied on the embedded default: no other process runs)")
        parser.add_argument("--no-follow", action="store_true",
                            help="resume and return (distributed mode only)")
        parser.add_argument("--quiet", action="store_true", help="no progress bar")

    def handle(self, *args, **opts) -> None:
        quiet_libraries(opts["verbosity"])
        job = job_or_error(opts["job"])
        reclaim = opts["reclaim"] or settings.EMBEDDED_WORKERS
        if opts["no_follow"] and not settings.EMBEDDED_WORKERS:
            job = services.job_resume(job_id=job.pk, reclaim=reclaim)
            self.stdout.write(f"job {job.pk}: {job.status}")
            return
        notice = leftover_notice(job.pk) if settings.EMBEDDED_WORKERS else None
        if notice:
            self.stdout.write(notice)
        started = time.monotonic()
        try:
            with sigterm_as_interrupt():
                snap = run_followed(job.pk, start=False, reclaim=reclaim, quiet=opts["quiet"],
                                    out=progress_stream(self.stdout))
        except KeyboardInterrupt as how:
            raise interrupted(job.pk, how) from None
        self.stdout.write(summary(snap, time.monotonic() - started,
                                  snap.job.config.get("threshold")))
        if snap.job.status != "succeeded":
            raise CommandError(f"job {job.pk} {snap.job.status}")
