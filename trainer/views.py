"""Job pages for operators (staff only): the list of jobs and one job's detail."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from store import selectors as store_selectors
from trainer import selectors, services
from trainer.models import JOB_TERMINAL, JobStatus, TrainingJob
from trainer.plots import Series, line_chart

# Seconds between reloads of a job page while the job runs (a meta refresh: no script).
REFRESH_SECONDS = 5


@staff_member_required
def job_list(request):
    jobs = TrainingJob.objects.select_related("project").order_by("-created_at")[:200]
    return render(request, "trainer/job_list.html", {"jobs": jobs})


def _series(rows: list[selectors.StepRow], key: str) -> list[tuple[float, float]]:
    return [(r.step.n, r.step.metrics[key]) for r in rows
            if isinstance(r.step.metrics.get(key), int | float)]


@staff_member_required
def job_detail(request, pk: int, workers: Callable[[], Any] | None = None):
    """`workers` (wired in lightning_site/urls.py, so trainer imports no runners code) gives
    the live workers per queue."""
    job = get_object_or_404(TrainingJob.objects.select_related("project"), pk=pk)
    rows = selectors.step_rows(job=job)
    per_second = [(r.step.n, r.rollouts_per_second) for r in rows if r.rollouts_per_second]
    charts = [
        line_chart([Series("train", _series(rows, "train_reward")),
                    Series("validation", _series(rows, "val_reward"))],
                   title="Reward per step", y_min=0.0),
        line_chart([Series("loss", _series(rows, "loss"))], title="Loss per step"),
        line_chart([Series("rollouts/s", per_second)], title="Throughput (rollouts/s)",
                   y_min=0.0),
    ]
    context = {
        "job": job,
        "rows": rows,
        "charts": charts,
        "throughput": selectors.job_throughput(rows=rows),
        "threshold": selectors.job_threshold_reached(job=job),
        "threshold_goal": (job.config or {}).get("threshold"),
        "rollout_counts": sorted(selectors.job_rollout_counts(job=job).items()),
        "checkpoints": selectors.job_checkpoints(job=job),
        "usage": selectors.job_usage(job=job),
        "project_usage": store_selectors.usage_totals(project=job.project),
        "share": selectors.job_share(job=job),
        "queues": workers() if workers else [],
        "waiting": [(step.n, reason) for step, reason in selectors.waiting_steps(job_id=job.pk)],
        "refresh_seconds": None if job.status in JOB_TERMINAL else REFRESH_SECONDS,
        "can_cancel": job.status not in JOB_TERMINAL,
        "can_resume": job.status in (JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.PENDING),
    }
    return render(request, "trainer/job_detail.html", context)


@require_POST
@staff_member_required
def job_cancel(request, pk: int):
    job = get_object_or_404(TrainingJob, pk=pk)
    job = services.job_cancel(job_id=job.pk)
    messages.success(request, f"Job {job.pk}: {job.status}.")
    return redirect("trainer:job_detail", pk=job.pk)


@require_POST
@staff_member_required
def job_resume(request, pk: int):
    job = get_object_or_404(TrainingJob, pk=pk)
    job = services.job_resume(job_id=job.pk)
    messages.success(request, f"Job {job.pk}: {job.status}, from its last finished step.")
    return redirect("trainer:job_detail", pk=job.pk)
