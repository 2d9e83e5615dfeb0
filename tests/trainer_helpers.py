"""Helpers of the trainer tests: run a job's queued rollouts in this process (through the
store's services, the way the executor does) and capture what the trainer sends."""

from __future__ import annotations

from dataclasses import dataclass, field

from runners.agent import RolloutInfo, call_agent, load_agent
from runners.tracing import attempt_tracing
from store import selectors as store_selectors
from store import services as store_services
from store.statemachine import QUEUED
from trainer import delivery, services
from trainer.models import TrainingJob


@dataclass
class Sent:
    """What the trainer asked the broker to deliver (captured instead of sent)."""

    train_steps: list[int] = field(default_factory=list)
    rollouts: list[str] = field(default_factory=list)


def capture_sends(monkeypatch) -> Sent:
    sent = Sent()
    monkeypatch.setattr(delivery, "send_train_step", sent.train_steps.append)
    monkeypatch.setattr(delivery, "send_rollouts", lambda _p, ids: sent.rollouts.extend(ids))
    return sent


def run_rollouts(job: TrainingJob, *, fail: bool = False) -> int:
    """Claim and run every queued rollout of the job's project; returns how many ran."""
    agent = load_agent(job.agent)
    ran = 0
    while True:
        claimed = store_services.rollout_dequeue(project=job.project, worker_id="test-runner")
        if claimed is None:
            return ran
        rollout, attempt = claimed
        resources = store_selectors.resources_get(
            project=job.project, resources_id=rollout.resources_id,
            version=rollout.resources_version,
        ).resources
        info = RolloutInfo(rollout_id=rollout.pk, attempt_id=attempt.attempt_id, mode=rollout.mode)
        with attempt_tracing(rollout_id=rollout.pk, attempt_id=attempt.attempt_id) as spans:
            call_agent(agent, task=rollout.input, resources=resources, rollout=info)
        store_services.spans_add(project=job.project, spans=spans.take())
        store_services.attempt_finish(
            project=job.project, rollout_id=rollout.pk, attempt_id=attempt.attempt_id,
            status="failed" if fail else "succeeded",
            error="RuntimeError: the agent could not read its checkpoint" if fail else None,
        )
        ran += 1


def drive(job: TrainingJob, sent: Sent, *, max_steps: int = 100) -> TrainingJob:
    """Run the loop in this process: rollouts, then each train step the trainer sent."""
    for _ in range(max_steps):
        run_rollouts(job)
        if not sent.train_steps:
            break
        while sent.train_steps:
            services.step_train(step_id=sent.train_steps.pop(0), worker="test-trainer")
    job.refresh_from_db()
    return job


def queued_count(job: TrainingJob) -> int:
    return job.project.rollouts.filter(status__in=QUEUED).count()
