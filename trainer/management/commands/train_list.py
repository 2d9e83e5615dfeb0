"""`manage.py train_list`: training jobs, newest first, with status and best reward."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from trainer import selectors


class Command(BaseCommand):
    help = ("List training jobs, newest first: status, steps done, best validation metric and "
            "checkpoint. Example: ./lightning train_list --project default --limit 10")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--project", help="only this project's jobs")
        parser.add_argument("--status", help="only jobs in this status (e.g. running)")
        parser.add_argument("--limit", type=int, default=20, help="at most this many (20)")

    def handle(self, *args, project, status, limit, **opts) -> None:
        rows = selectors.job_list(project=project, status=status, limit=limit)
        if not rows:
            self.stdout.write("no training jobs")
            return
        self.stdout.write(f"{'job':>5}  {'status':9}  {'steps':>7}  {'best':>7}  "
                          f"{'checkpoint':>10}  {'created':16}  project/name")
        # Steps count from 0 (the untrained policy's), as the progress bar does.
        for row in rows:
            job = row.job
            best = f"{job.best_metric:.3f}" if job.best_metric is not None else "-"
            checkpoint = f"v{job.best_version}" if job.best_version is not None else "-"
            self.stdout.write(
                f"{job.pk:>5}  {job.status:9}  {row.steps_done:>3}/{job.total_steps + 1:<3}  "
                f"{best:>7}  {checkpoint:>10}  {job.created_at:%Y-%m-%d %H:%M}  "
                f"{job.project.name}/{job.name or '-'}")
