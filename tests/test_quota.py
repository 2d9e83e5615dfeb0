"""A project's GPU-seconds-per-day quota (README "Quotas"): past it, its training steps wait
before their claim (one worker and each gang member), shown with the reason where operators
look, no rollouts planned meanwhile; they start by themselves once usage ages out of the
rolling 24 h window (time moved by ledger rows' `created_at`, never by sleeping); no cap
changes nothing; bad caps are refused. Then the same with a real Celery training worker."""

from __future__ import annotations

import math
from datetime import UTC, timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from store import rules
from store import selectors as store_selectors
from store import services as store_services
from store.errors import InvalidInput
from store.models import Project, UsageEntry
from tests.celery_fixtures import use_broker, wait_until
from tests.test_trainer_celery import finished
from tests.test_trainer_gang import gang_job
from tests.test_trainer_services import make_job
from tests.trainer_helpers import capture_sends, run_rollouts
from trainer import gang, selectors, services
from trainer.models import GangMember, JobStatus, StepStatus, TrainingStep


def gpu_row(project: Project, gpu_seconds: float, hours_ago: float) -> UsageEntry:
    """A training step's ledger row written `hours_ago` (how time moves in these tests)."""
    return UsageEntry.objects.create(
        project=project, kind=UsageEntry.Kind.STEP, gpu_seconds=gpu_seconds, gpu_type="H100",
        created_at=timezone.now() - timedelta(hours=hours_ago))


def age(rows: list[UsageEntry], hours: float) -> None:
    """`hours` pass for these rows."""
    for row in rows:
        UsageEntry.objects.filter(pk=row.pk).update(
            created_at=row.created_at - timedelta(hours=hours))


@pytest.fixture
def checkpoints(settings, tmp_path) -> dict:
    """Checkpoints in a folder of the test's: the storage here, the env for workers."""
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path)}}}
    return {"CHECKPOINT_DIR": str(tmp_path)}


def ready_step(monkeypatch, **config):
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job(steps=1, **config).pk)
    run_rollouts(job)
    return job, job.steps.get(n=0), sent


@pytest.mark.django_db(transaction=True)
def test_a_step_past_the_quota_waits_with_the_reason_and_starts_when_usage_ages_out(
        monkeypatch, staff, checkpoints):
    job, step, sent = ready_step(monkeypatch)
    project = job.project
    store_services.project_quota_set(project=project, gpu_seconds_per_day=3600)
    old = gpu_row(project, 1000, hours_ago=23.5)
    recent = gpu_row(project, 2612, hours_ago=2)
    gpu_row(project, 5000, hours_ago=24.01)  # out of the window: not counted
    gpu_row(store_services.project_create(name="elsewhere"), 9000, hours_ago=1)
    frees = (old.created_at + rules.QUOTA_WINDOW).astimezone(UTC)
    reason = (f"quota: 3,612 of 3,600 GPU-seconds in the last 24 h; next free at "
              f"{frees:%H:%M} UTC")

    step_id = sent.train_steps.pop()
    assert services.step_train(step_id=step_id, worker="w") == "quota"
    step.refresh_from_db()
    assert (step.status, step.attempts, step.worker) == (StepStatus.READY, 0, "")
    assert selectors.waiting_steps(job_id=job.pk) == [(step, reason)]
    out = StringIO()
    call_command("train_show", str(job.pk), stdout=out)
    assert f"waiting: {reason}" in out.getvalue()
    out = StringIO()
    call_command("queue_watch", project.name, "--once", stdout=out)
    assert f"training step 0 of job {job.pk}: waiting: {reason}" in out.getvalue()
    assert reason in staff.get(f"/jobs/{job.pk}/").text
    assert reason in staff.get(f"/admin/store/project/{project.pk}/change/").text
    assert selectors.training_backlog() == (0, 0)  # waits for time: no worker wanted for it

    # The sweep sends it again and it waits again; nothing new is planned meanwhile.
    rollouts = project.rollouts.count()
    services.steps_sweep(force=True)
    assert sent.train_steps == [step_id]
    assert services.step_train(step_id=sent.train_steps.pop(), worker="w") == "quota"
    assert project.rollouts.count() == rollouts and job.steps.count() == 1

    age([old, recent], hours=0.6)  # `old` leaves the window: 2,612 left, under the cap
    assert selectors.waiting_steps(job_id=job.pk) == []
    assert selectors.training_backlog() == (1, 0)
    services.steps_sweep(force=True)
    assert services.step_train(step_id=sent.train_steps.pop(), worker="w") == "done"
    step.refresh_from_db()
    assert (step.status, step.attempts) == (StepStatus.DONE, 1)


@pytest.mark.django_db
def test_no_cap_or_a_cap_not_reached_changes_nothing(monkeypatch):
    job, step, sent = ready_step(monkeypatch)
    gpu_row(job.project, 1e6, hours_ago=1)
    assert store_selectors.gpu_quotas(project_ids=[job.project.pk]) == {}
    assert selectors.step_quota_reason(step_id=step.pk) is None
    store_services.project_quota_set(project=job.project, gpu_seconds_per_day=2e6)
    quota = store_selectors.gpu_quotas(project_ids=[job.project.pk])[job.project.pk]
    assert (quota.used, quota.reached, quota.next_free) == (1e6, False, None)
    assert quota.describe() == "quota: 1,000,000 of 2,000,000 GPU-seconds in the last 24 h"
    assert selectors.waiting_steps(job_id=job.pk) == []
    assert services.step_quota_wait(step.pk) is None


@pytest.mark.django_db
def test_the_quota_frees_when_enough_of_the_oldest_usage_left_the_window():
    project = store_services.project_create(name="walk")
    store_services.project_quota_set(project=project, gpu_seconds_per_day=100)
    rows = [gpu_row(project, g, hours_ago=h) for g, h in [(30, 20), (30, 10), (50, 5), (40, 1)]]
    quota = store_selectors.gpu_quotas(project_ids=[project.pk])[project.pk]
    # 150 used: without the two oldest (60) 90 < 100 is left; without only the first, 120.
    assert quota.used == 150 and quota.next_free == rows[1].created_at + rules.QUOTA_WINDOW
    store_services.project_quota_set(project=project, gpu_seconds_per_day=0)
    quota = store_selectors.gpu_quotas(project_ids=[project.pk], reached_only=True)[project.pk]
    assert quota.next_free is None
    assert quota.describe() == ("quota: 150 of 0 GPU-seconds in the last 24 h; a cap of 0 "
                                "holds every training step")
    store_services.project_quota_set(project=project, gpu_seconds_per_day=None)
    assert store_selectors.gpu_quotas(project_ids=[project.pk]) == {}


@pytest.mark.django_db
def test_a_gang_member_does_not_join_while_the_quota_is_reached():
    job = gang_job("gang-quota")
    services.job_start(job_id=job.pk)
    step = job.steps.get(n=0)
    TrainingStep.objects.filter(pk=step.pk).update(status=StepStatus.READY)
    store_services.project_quota_set(project=job.project, gpu_seconds_per_day=0)
    assert gang.step_train(step_id=step.pk, worker="celery:training-a@h:11") == "quota"
    assert not GangMember.objects.filter(step=step).exists()
    step.refresh_from_db()
    assert (step.status, step.attempts) == (StepStatus.READY, 0)
    assert selectors.step_waiting_reason(step=step, workers=[]).startswith("quota: 0 of 0")


@pytest.mark.django_db
@pytest.mark.parametrize("cap", [-1, -0.5, math.nan, math.inf, True, "3600", [1]])
def test_a_bad_cap_is_refused_and_nothing_changes(cap):
    project = store_services.project_create(name="bad-cap")
    store_services.project_quota_set(project=project, gpu_seconds_per_day=10)
    with pytest.raises(InvalidInput, match="gpu_seconds_per_day: must be a finite number"):
        store_services.project_quota_set(project=project, gpu_seconds_per_day=cap)
    project.refresh_from_db()
    assert project.gpu_seconds_per_day == 10


@pytest.mark.django_db
def test_quota_set_sets_shows_and_removes_a_cap_and_refuses_bad_input():
    project = store_services.project_create(name="cli")
    out = StringIO()
    call_command("quota_set", "--project", "cli", "--gpu-seconds-per-day", "3600", stdout=out)
    assert out.getvalue().splitlines() == [
        "project cli: gpu_seconds_per_day=3600",
        "quota: 0 of 3,600 GPU-seconds in the last 24 h"]
    out = StringIO()
    call_command("quota_set", "--project", "cli", stdout=out)  # shows, changes nothing
    assert "gpu_seconds_per_day=3600" in out.getvalue()
    for bad, message in [("lots", "a cap is a number or 'none'"),
                         ("-5", "must be a finite number >= 0"), ("nan", "finite")]:
        with pytest.raises(CommandError, match=message):
            call_command("quota_set", "--project", "cli", "--gpu-seconds-per-day", bad)
    with pytest.raises(CommandError, match="no project named 'nope'"):
        call_command("quota_set", "--project", "nope", "--gpu-seconds-per-day", "1")
    call_command("quota_set", "--project", "cli", "--gpu-seconds-per-day", "none",
                 stdout=StringIO())
    project.refresh_from_db()
    assert project.gpu_seconds_per_day is None


@pytest.mark.django_db
def test_the_admin_sets_the_cap_and_refuses_a_negative_one(staff):
    project = store_services.project_create(name="admin-cap")
    url = f"/admin/store/project/{project.pk}/change/"
    form = {"name": "admin-cap", "description": "", "share_weight": "1",
            "api_keys-TOTAL_FORMS": "0", "api_keys-INITIAL_FORMS": "0",
            "parties-TOTAL_FORMS": "0", "parties-INITIAL_FORMS": "0"}
    answer = staff.post(url, {**form, "gpu_seconds_per_day": "-1"})
    assert answer.status_code == 200 and "greater than or equal to 0" in answer.text
    staff.post(url, {**form, "gpu_seconds_per_day": "7200"})
    project.refresh_from_db()
    assert project.gpu_seconds_per_day == 7200


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_celery_training_worker_leaves_the_step_waiting_then_trains_it_once_freed(
        rabbitmq_url, celery_workers, checkpoints):
    env = checkpoints
    celery_workers(queues=["rollouts"], broker_url=rabbitmq_url, concurrency=2, env=env)
    trainer = celery_workers(queues=["training"], broker_url=rabbitmq_url, concurrency=1,
                             env=env)
    with use_broker(rabbitmq_url):
        job = make_job(steps=1, resend_seconds=1)
        store_services.project_quota_set(project=job.project, gpu_seconds_per_day=3600)
        rows = [gpu_row(job.project, 3600, hours_ago=12)]
        job = services.job_start(job_id=job.pk)

        def held_twice() -> bool:
            services.steps_sweep()  # celery-beat's part: the step is sent again
            return trainer.log().count("waits: quota: 3,600 of 3,600") >= 2

        wait_until(held_twice, timeout=180, message="the worker never held step 0 back")
        step = job.steps.get(n=0)
        assert (step.status, step.attempts) == (StepStatus.READY, 0)
        assert job.steps.count() == 1
        age(rows, hours=13)
        wait_until(lambda: finished(job, sweep=True), timeout=180,
                   message="the job did not finish once freed")
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert list(job.steps.values_list("n", "status", "attempts").order_by("n")) == [
        (0, "done", 1), (1, "done", 1)]
