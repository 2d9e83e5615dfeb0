"""Reads of the trainer: a step's finished rollouts with their spans, job overviews."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.db.models import Count, F, Q, Sum
from django.urls import reverse
from django.utils import timezone

from core import control, devices
from core.queues import Queue
from store import selectors as store_selectors
from store.models import ResourceVersion, Rollout, RolloutGroup, Span
from store.statemachine import ROLLOUT_TERMINAL, RolloutStatus
from trainer import conventions as c
from trainer import staleness
from trainer.algorithms import FinishedRollout
from trainer.models import GangMember, JobStatus, StepStatus, TrainingJob, TrainingStep


def training_backlog() -> tuple[int, int]:
    """(queued, running) training steps: ready ones wait for a training worker, training ones
    hold one (the scaling signal of the training queue, core/scaling.py). A ready step of a
    project past its GPU quota waits for time, not for a worker: not counted."""
    counts = list(TrainingStep.objects.filter(status__in=[StepStatus.READY, StepStatus.TRAINING])
                  .values_list("status", "job__project_id").annotate(n=Count("pk")).order_by())
    held = store_selectors.gpu_quotas(
        project_ids={p for status, p, _ in counts if status == StepStatus.READY},
        reached_only=True)
    queued = sum(n for status, p, n in counts if status == StepStatus.READY and p not in held)
    return queued, sum(n for status, _, n in counts if status == StepStatus.TRAINING)


def step_rollouts(*, step: TrainingStep) -> Any:
    """The step's rollouts of its current round (all statuses): the members of its group,
    served by the index rollout_group."""
    if step.group_id is None:
        return Rollout.objects.none()
    return Rollout.objects.filter(group_id=step.group_id)


def job_groups(*, job: TrainingJob) -> Any:
    """The rollout groups of every step and round of the job (found by their unique keys)."""
    keys = [key for step in job.steps.only("pk", "round") for key in step.group_keys()]
    return RolloutGroup.objects.filter(project_id=job.project_id, key__in=keys)


def job_usage(*, job: TrainingJob) -> store_selectors.UsageTotals:
    """The job's cost ledger totals: its attempts' rows and its steps' (all carry one of the
    job's rollout groups)."""
    return store_selectors.usage_totals(group_ids=job_groups(job=job).values("pk"))


def job_party(job: TrainingJob) -> str:
    """The job's party of the store's fair share (README "Scheduling"): its rollouts share
    the project's slots with the project's other jobs by their weights (`share_set --party`)."""
    return f"trainer/job/{job.pk}"


@dataclass(frozen=True)
class JobShare:
    """The job's project's fair share (store_selectors.share_state) and the job's own party
    (None before its first rollout)."""

    project: store_selectors.ShareState
    key: str
    party: store_selectors.PartyShare | None

    def describe(self) -> str:
        mine = (f"job party {self.key}: weight {self.party.weight:g}, usage "
                f"{self.party.usage:.1f}" if self.party else
                f"job party {self.key}: weight 1 (no rollouts yet)")
        return f"{self.project.describe()}; {mine}"


def job_share(*, job: TrainingJob) -> JobShare:
    share = store_selectors.share_state(project=job.project)
    key = job_party(job)
    return JobShare(share, key, next((p for p in share.parties if p.key == key), None))


def job_rollouts(*, job: TrainingJob) -> Any:
    """Every rollout the job planned, through its groups (no key parsing, no LIKE)."""
    return Rollout.objects.filter(group__in=job_groups(job=job))


def step_open_rollout_ids(*, step: TrainingStep) -> list[str]:
    return list(
        step_rollouts(step=step).exclude(status__in=ROLLOUT_TERMINAL).values_list("pk", flat=True)
    )


def step_finished_rollouts(*, step: TrainingStep) -> list[FinishedRollout]:
    """Terminal rollouts of the step with the spans of their latest attempt, in plan order."""
    return _finished(step_rollouts(step=step).filter(status__in=ROLLOUT_TERMINAL))


def _finished(rollouts: Any) -> list[FinishedRollout]:
    """FinishedRollouts of a queryset of terminal rollouts, in plan order."""
    rows = list(
        rollouts.values("pk", "mode", "status", "input", "resources_version", "metadata")
        # plan order: one enqueue stamps its rollouts' start_time a microsecond apart
        .order_by("start_time", "pk")
    )
    spans = _latest_spans([r["pk"] for r in rows])
    return [
        FinishedRollout(rollout_id=r["pk"], mode=r["mode"] or "train", status=r["status"],
                        input=r["input"], spans=spans[r["pk"]],
                        version=staleness.rollout_version(r["resources_version"],
                                                          spans[r["pk"]],
                                                          partial=_partial(r["metadata"])))
        for r in rows
    ]


def _partial(metadata: Any) -> bool:
    """A partial rollout (trainer/conventions.py LLM_LATEST): its calls on the newest version."""
    return isinstance(metadata, dict) and metadata.get(c.LLM_LATEST) is True


def _latest_spans(rollout_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    spans: dict[str, list[dict[str, Any]]] = defaultdict(list)
    rows = Span.objects.filter(
        rollout_id__in=rollout_ids, attempt_id=F("rollout__latest_attempt_id")
    ).values("rollout_id", "name", "attributes", "sequence_id")
    for row in rows.iterator():
        spans[row["rollout_id"]].append(row)
    return spans


def job_consumed(*, job: TrainingJob) -> set[str]:
    """The rollouts the job's done steps trained on (asynchronous jobs consuming groups)."""
    consumed: set[str] = set()
    for trained in job.steps.filter(status=StepStatus.DONE).values_list("trained", flat=True):
        consumed.update(trained or [])
    return consumed


def pool_units(*, job: TrainingJob, through_n: int, spans: bool = False,
               ) -> tuple[list[staleness.Unit], dict[str, FinishedRollout]]:
    """The train groups not trained on yet in the current rounds of steps 0..`through_n`
    (staleness.Unit: plan order, completeness, oldest version), and with `spans` the
    FinishedRollouts of the complete ones, their versions read from their LLM spans too
    (without: their pins). One query of rollouts, one of spans."""
    steps = {s["group_id"]: s for s in job.steps.filter(n__lte=through_n, group__isnull=False)
             .exclude(status__in=[StepStatus.FAILED, StepStatus.CANCELLED])
             .values("n", "round", "group_id")}
    consumed = job_consumed(job=job)
    rows = (Rollout.objects.filter(group_id__in=list(steps))
            .values("pk", "mode", "status", "input", "resources_version", "group_id",
                    "metadata")
            .order_by("start_time", "pk"))
    members: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if (row["mode"] or "train") != "train" or row["pk"] in consumed:
            continue
        task = row["input"].get("group") if isinstance(row["input"], dict) else None
        members[(row["group_id"], task if task is not None else row["pk"])].append(row)
    complete = {key for key, rs in members.items()
                if all(r["status"] in ROLLOUT_TERMINAL for r in rs)}
    finished: dict[str, FinishedRollout] = {}
    if spans:
        ids = [r["pk"] for key in complete for r in members[key]]
        by_id = _latest_spans(ids)
        for key in complete:
            for r in members[key]:
                finished[r["pk"]] = FinishedRollout(
                    rollout_id=r["pk"], mode="train", status=r["status"], input=r["input"],
                    spans=by_id[r["pk"]],
                    version=staleness.rollout_version(r["resources_version"], by_id[r["pk"]],
                                                      partial=_partial(r["metadata"])))
    units = []
    for index, (key, rs) in enumerate(members.items()):
        step = steps[key[0]]
        pinned = [finished[r["pk"]].version if r["pk"] in finished else r["resources_version"]
                  for r in rs]
        known = [v for v in pinned if v is not None]
        units.append(staleness.Unit(
            key=key, order=(step["n"], step["round"], index),
            rollout_ids=tuple(r["pk"] for r in rs), version=min(known) if known else None,
            complete=key in complete,
            cancelled=any(r["status"] == RolloutStatus.CANCELLED for r in rs)))
    return units, finished


def step_rollout_counts(*, step: TrainingStep) -> dict[str, int]:
    return dict(step_rollouts(step=step).values_list("status").annotate(n=Count("pk")))


def job_rollout_counts(*, job: TrainingJob) -> dict[str, int]:
    return dict(job_rollouts(job=job).values_list("status").annotate(n=Count("pk")))


def job_finished_count(*, job: TrainingJob) -> int:
    """How many of the job's rollouts finished: the sum of its groups' counters (a progress
    poll reads a few group rows, never the rollouts)."""
    return job_groups(job=job).aggregate(n=Sum("finished"))["n"] or 0


def step_rollouts_url(step: TrainingStep) -> str:
    """The admin's rollout list filtered to the step's current group."""
    return (reverse("admin:store_rollout_changelist")
            + "?" + urlencode({"group__id__exact": step.group_id or 0}))


def job_checkpoints(*, job: TrainingJob) -> list[ResourceVersion]:
    if not job.resources_id:
        return []
    return list(ResourceVersion.objects.filter(resource_set__project_id=job.project_id,
                                               resource_set__resources_id=job.resources_id)
                .order_by("version"))


def job_last_done_step(*, job: TrainingJob) -> TrainingStep | None:
    return job.steps.filter(status="done").order_by("-n").first()


@dataclass
class StepRow:
    step: TrainingStep
    wait_seconds: float | None
    rollouts_per_second: float | None
    admin_rollouts_url: str


def _seconds_between(timings: dict[str, Any], start: str, end: str) -> float | None:
    if start not in timings or end not in timings:
        return None
    delta = datetime.fromisoformat(timings[end]) - datetime.fromisoformat(timings[start])
    return delta.total_seconds()


def step_rows(*, job: TrainingJob) -> list[StepRow]:
    rows = []
    for step in job.steps.order_by("n"):
        wait = _seconds_between(step.timings, "planned", "ready")
        total = step.rollout_count + step.val_rollout_count
        rows.append(StepRow(step, wait, total / wait if wait else None, step_rollouts_url(step)))
    return rows


def job_throughput(*, rows: list[StepRow]) -> dict[str, float | None]:
    """Overall figures of the finished steps: rollouts/s while waiting, seconds per step
    spent waiting for rollouts and training."""
    done = [r for r in rows if r.step.status == "done" and r.wait_seconds is not None]
    waited = sum(r.wait_seconds for r in done)
    trained = sum(r.step.timings.get("train_seconds", 0.0) for r in done)
    rollouts = sum(r.step.rollout_count + r.step.val_rollout_count for r in done)
    return {
        "steps": len(done),
        "rollouts_per_second": rollouts / waited if waited else None,
        "wait_seconds_per_step": waited / len(done) if done else None,
        "train_seconds_per_step": trained / len(done) if done else None,
    }


@dataclass
class JobRow:
    job: TrainingJob
    steps_done: int


def job_list(*, project: str | None = None, status: str | None = None, limit: int = 20
             ) -> list[JobRow]:
    """Jobs newest first with their finished step count (one query)."""
    jobs = TrainingJob.objects.select_related("project").annotate(
        steps_done=Count("steps", filter=Q(steps__status=StepStatus.DONE))
    ).order_by("-created_at", "-pk")
    if project:
        jobs = jobs.filter(project__name=project)
    if status:
        jobs = jobs.filter(status=status)
    return [JobRow(job, job.steps_done) for job in jobs[:limit]]


@dataclass(frozen=True)
class ThresholdReached:
    threshold: float
    step: int  # the first step whose validation reward reached it
    seconds: float  # from the job's start to that step's rollouts being done


def job_threshold_reached(*, job: TrainingJob) -> ThresholdReached | None:
    """When the job's validation reward first reached its config's `threshold`, if it did."""
    threshold = (job.config or {}).get("threshold")
    if not isinstance(threshold, int | float) or job.started_at is None:
        return None
    for step in job.steps.order_by("n"):
        reward = step.metrics.get("val_reward")
        if isinstance(reward, int | float) and reward >= threshold and "ready" in step.timings:
            at = datetime.fromisoformat(step.timings["ready"])
            return ThresholdReached(threshold, step.n, (at - job.started_at).total_seconds())
    return None


def step_quota_reason(*, step_id: int) -> str | None:
    """Why a step of a running job may not start training yet: its project reached its GPU
    quota ("quota: 3,612 of 3,600 GPU-seconds in the last 24 h; next free at 14:05 UTC",
    README "Quotas"); None when it may, or when it is gone."""
    project_id = (TrainingStep.objects.filter(pk=step_id, job__status=JobStatus.RUNNING)
                  .values_list("job__project_id", flat=True).first())
    if project_id is None:
        return None
    return store_selectors.gpu_quota_reason(project_id=project_id)


def step_waiting_reason(*, step: TrainingStep,
                        workers: list[tuple[str, list[dict]]] | None = None,
                        quotas: dict[int, store_selectors.GpuQuota] | None = None) -> str | None:
    """Why a step ready to train (or left by a dead worker) waits: its project reached its
    GPU quota (`quotas`: the reached ones by project id, read here when not given), its
    job's `resources` fit no live training worker ("needs 2 GPUs with >= 40 GB; live
    training workers: ..."), or its gang (job config `nodes`) is gathering or lacks live
    workers. None when nothing stands in its way, when the step is not waiting for a worker,
    or with no registry wired."""
    waiting = step.status == StepStatus.READY or (
        step.status == StepStatus.TRAINING and step.lease_until is not None
        and step.lease_until < timezone.now())
    if not waiting:
        return None
    if quotas is None:
        quotas = store_selectors.gpu_quotas(project_ids=[step.job.project_id],
                                            reached_only=True)
    if (quota := quotas.get(step.job.project_id)) is not None:
        return quota.describe()
    config = step.job.config or {}
    need = devices.resources_parse(config.get("resources"))
    nodes = int(config.get("nodes", 1))
    if not need.any and nodes <= 1:
        return None
    if workers is None:
        workers = control.live_worker_devices(Queue.TRAINING.value)
    if workers is None:
        return None
    if need.any and (reason := devices.unmet_reason(need, workers)) is not None:
        return reason
    return _gang_reason(step, nodes, need, workers) if nodes > 1 else None


def _gang_reason(step: TrainingStep, nodes: int, need: devices.Resources,
                 workers: list[tuple[str, list[dict]]]) -> str | None:
    """"gang of 2 training workers: 1 joined (celery:a@h:12), waiting for 1 more; live
    training workers that fit: 1" while members gather; "needs a gang of 2 training workers;
    live training workers that fit: 1 (a@h)" when too few are alive."""
    fit = [name for name, held in workers if devices.fits(held, need)]
    live = f"live training workers that fit: {len(fit)}"
    if fit:
        live += f" ({', '.join(fit)})"
    joined = list(GangMember.objects.filter(step=step, attempt=step.attempts + 1)
                  .order_by("node_rank").values_list("worker", flat=True))
    if joined:
        return (f"gang of {nodes} training workers: {len(joined)} joined "
                f"({', '.join(joined)}), waiting for {nodes - len(joined)} more; {live}")
    if len(fit) < nodes:
        return f"needs a gang of {nodes} training workers; {live}"
    return None


def waiting_steps(*, project_id: int | None = None, job_id: int | None = None
                  ) -> list[tuple[TrainingStep, str]]:
    """Open steps of running jobs (of one project, or one job) that no live training worker
    can take, with the reason; the registry is read once."""
    steps = (TrainingStep.objects.select_related("job")
             .filter(status__in=[StepStatus.READY, StepStatus.TRAINING],
                     job__status=JobStatus.RUNNING).order_by("job_id", "n"))
    if project_id is not None:
        steps = steps.filter(job__project_id=project_id)
    if job_id is not None:
        steps = steps.filter(job_id=job_id)
    workers = control.live_worker_devices(Queue.TRAINING.value)
    steps = list(steps)
    quotas = store_selectors.gpu_quotas(project_ids={s.job.project_id for s in steps},
                                        reached_only=True)
    found = []
    for step in steps:
        if (reason := step_waiting_reason(step=step, workers=workers,
                                          quotas=quotas)) is not None:
            found.append((step, reason))
    return found


def waiting_lines(project_id: int | None) -> list[str]:
    """For queue_watch (core.control.register_waiting): one line per waiting step."""
    return [f"training step {step.n} of job {step.job_id}: waiting: {reason}"
            for step, reason in waiting_steps(project_id=project_id)]
