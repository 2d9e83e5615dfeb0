"""`manage.py train_show JOB [--follow]`: a job's status and steps."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from core.console import progress_stream
from store import selectors as store_selectors
from trainer import progress, selectors
from trainer.management.commands.train import job_or_error


class Command(BaseCommand):
    help = "Show a training job: status, error, and each step's metrics."

    def add_arguments(self, parser) -> None:
        parser.add_argument("job", type=int, help="the job's id (train_list shows them)")
        parser.add_argument("--follow", action="store_true", help="follow until it ends")

    def handle(self, *args, **opts) -> None:
        job = job_or_error(opts["job"])
        if opts["follow"]:
            progress.follow(job.pk, file=progress_stream(self.stdout))
            job.refresh_from_db()
        self.stdout.write(f"job {job.pk} {job.name} [{job.status}] agent={job.agent} "
                          f"algorithm={job.algorithm} steps={job.total_steps} "
                          f"checkpoints={job.resources_id} best=v{job.best_version or '-'}")
        if job.surplus_groups:  # README "Asynchronous training": spare groups
            self.stdout.write(f"spare groups left untrained: {job.surplus_groups} "
                              f"({job.surplus_rollouts} rollouts, open ones cancelled)")
        waiting = {step.pk: reason for step, reason in selectors.waiting_steps(job_id=job.pk)}
        for step in job.steps.order_by("n"):
            m = step.metrics
            fields = [f"step {step.n:3d}", f"{step.status:9s}", f"v{step.resources_version}"
                      f"->v{step.produced_version or '-'}", f"tries={step.attempts}",
                      f"device={step.device or '-'}"]
            fields += [f"{k}={m[k]:.4f}" for k in ("train_reward", "val_reward", "loss")
                       if isinstance(m.get(k), int | float)]
            if "staleness_max" in m:  # an asynchronous job (README "Asynchronous training")
                fields.append(f"staleness={m['staleness_mean']:.2f}/max {m['staleness_max']}")
            if m.get("samples_replanned"):
                fields.append(f"replanned={m['samples_replanned']}")
            if step.pk in waiting:
                fields.append(f"waiting: {waiting[step.pk]}")
            self.stdout.write("  ".join(fields))
        self.stdout.write(f"cost: job {selectors.job_usage(job=job).describe()}; project "
                          f"{job.project.name} "
                          f"{store_selectors.usage_totals(project=job.project).describe()}")
        self.stdout.write(selectors.job_share(job=job).describe())  # README "Scheduling"
        if job.error:
            self.stdout.write(self.style.ERROR(job.error))
        if job.status == "failed":  # scripts see it: a failed job exits non-zero
            raise CommandError(f"job {job.pk} failed")
