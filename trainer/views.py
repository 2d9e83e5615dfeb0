"""Job pages for operators (staff only): the list of jobs and one job's detail."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib.admin.views.decorators import staff_member_required
from django.shortcuts import get_object_or_404, render

from trainer import selectors
from trainer.models import TrainingJob
from trainer.plots import Series, line_chart


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
        "rollout_counts": sorted(selectors.job_rollout_counts(job=job).items()),
        "checkpoints": selectors.job_checkpoints(job=job),
        "queues": workers() if workers else [],
    }
    return render(request, "trainer/job_detail.html", context)
