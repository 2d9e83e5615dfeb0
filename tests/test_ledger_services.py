"""The cost ledger (README "Cost"): the price arithmetic, one row per runner's verdict in its
transaction on both write paths (the verdict statement and the full path) with the gateway's
tokens, the step's row, the totals shown, and the CPU-seconds reconciled with a real worker's
own process accounting."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connection, transaction
from prometheus_client.parser import text_string_to_metric_families

from core.env import env_prices
from runners import services as runner_services
from store import selectors, services, watchdog
from store.errors import IllegalTransition, InvalidInput
from store.models import Attempt, Span, UsageEntry
from store.services import RolloutSpec, Usage, _ledger
from store.services.attempts import AttemptUpdate
from tests.celery_fixtures import wait_until
from tests.conftest import backdate, claim, enqueue
from tests.test_trainer_services import make_job
from tests.trainer_helpers import capture_sends, run_rollouts
from trainer import selectors as trainer_selectors
from trainer import services as trainer_services

PRICES = {"COST_PER_CPU_SECOND": 0.01, "COST_PER_GPU_SECOND": {"H100": 2.0, "*": 0.5},
          "COST_PER_1K_TOKENS": 0.3}


@pytest.fixture
def prices(settings):
    for name, value in PRICES.items():
        setattr(settings, name, value)
    return settings


def test_the_price_arithmetic_is_pinned(prices):
    h100 = Usage(cpu_seconds=3, gpu_seconds=10, gpu_type="NVIDIA H100 80GB HBM3")
    assert _ledger.cost_of(h100, 2500) == pytest.approx(3 * 0.01 + 10 * 2.0 + 2.5 * 0.3)
    assert _ledger.cost_of(h100, 2500) == pytest.approx(20.78)
    assert _ledger.gpu_price("Tesla T4") == 0.5  # the "*" entry
    assert _ledger.cost_of(Usage(cpu_seconds=0.5), 0) == pytest.approx(0.005)
    prices.COST_PER_GPU_SECOND = {"A100": 1.0}
    assert _ledger.gpu_price("NVIDIA H100") == 0.0  # no "*": unpriced
    assert _ledger.cost_of(Usage(), 1000) == pytest.approx(0.3)


def test_the_price_list_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("COST_PER_GPU_SECOND", "NVIDIA H100=0.002, *=0.0005")
    assert env_prices("COST_PER_GPU_SECOND", {}) == {"NVIDIA H100": 0.002, "*": 0.0005}
    for bad in ("H100", "H100=-1", "=3", "H100=cheap"):
        monkeypatch.setenv("COST_PER_GPU_SECOND", bad)
        with pytest.raises(ImproperlyConfigured):
            env_prices("COST_PER_GPU_SECOND", {})


@pytest.mark.parametrize("bad", [{"cpu_seconds": -1.0}, {"gpu_seconds": float("nan")},
                                 {"cpu_seconds": float("inf")}, {"cpu_seconds": True}])
def test_usage_refuses_what_is_not_a_finite_nonnegative_number(bad):
    with pytest.raises(InvalidInput):
        Usage(**bad)


def _gateway_span(attempt: Attempt, n: int, tokens, system: str = "lightning") -> Span:
    return Span.objects.create(
        rollout_id=attempt.rollout_id, attempt=attempt, sequence_id=n, trace_id="t" * 32,
        span_id=f"{n:016x}", name="chat", attributes={
            "gen_ai.system": system, "gen_ai.usage.completion_tokens": tokens})


def _spans_for(attempt: Attempt) -> int:
    """Gateway spans of 7 + 5 tokens, plus spans that are not the gateway's tokens."""
    _gateway_span(attempt, 1, 7)
    _gateway_span(attempt, 2, 5.9)  # truncated: 5
    _gateway_span(attempt, 3, 100, system="openai")  # the agent's own instrumentation
    _gateway_span(attempt, 4, "12")  # not a number
    return 12


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_token_and_cost_rules_give_the_same_answers_in_python_and_sql(prices, project):
    enqueue(project, 2)
    _, first = claim(project)
    _, second = claim(project)
    expected = _spans_for(first)
    assert _ledger.gateway_tokens([first.pk, second.pk]) == {first.pk: expected}
    usage = Usage(cpu_seconds=1.25, gpu_seconds=3.5, gpu_type="H100")
    with connection.cursor() as cursor:
        for attempt, tokens in ((first, expected), (second, 0)):
            cursor.execute(f"SELECT {_ledger.gateway_tokens_sql('%s')}", [attempt.pk])
            assert cursor.fetchone()[0] == tokens
            cursor.execute(f"SELECT {_ledger.cost_sql('%s')}",
                           [_ledger.fixed_cost(usage), tokens, prices.COST_PER_1K_TOKENS])
            assert cursor.fetchone()[0] == _ledger.cost_of(usage, tokens)  # the same float


def _finish(project, attempt, usage, *, path: str) -> None:
    if path == "statement":  # autocommit: the one-statement verdict (Postgres)
        services.attempt_finish(project=project, rollout_id=attempt.rollout_id,
                                attempt_id=attempt.attempt_id, status="succeeded", usage=usage)
    else:  # inside a transaction: the full path
        with transaction.atomic():
            services.attempt_update_many(project=project, updates=[AttemptUpdate(
                attempt.rollout_id, attempt.attempt_id, "succeeded", usage=usage)])


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["statement", "full"])
def test_a_runners_verdict_writes_one_ledger_row_with_the_gateways_tokens(prices, project, path):
    group, _ = services.group_create(project=project, key="g", owner="test")
    services.rollout_enqueue_many(project=project, specs=[RolloutSpec(input={})], group=group)
    rollout, attempt = claim(project)
    tokens = _spans_for(attempt)
    usage = Usage(cpu_seconds=2.0, gpu_seconds=1.5, gpu_type="NVIDIA H100")
    _finish(project, attempt, usage, path=path)
    row = UsageEntry.objects.get()
    assert (row.kind, row.rollout_id, row.attempt_id, row.group_id, row.project_id) == (
        "attempt", rollout.pk, attempt.attempt_id, group.pk, project.pk)
    assert (row.cpu_seconds, row.gpu_seconds, row.gpu_type, row.tokens) == (
        2.0, 1.5, "NVIDIA H100", tokens)
    assert row.cost == _ledger.cost_of(usage, tokens)
    # The same verdict again changes nothing and writes nothing.
    _finish(project, attempt, usage, path=path)
    assert UsageEntry.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_verdict_that_fails_writes_no_ledger_row(project):
    """The row is the verdict's: a verdict refused (illegal after another final one) leaves
    no row behind."""
    enqueue(project)
    _, attempt = claim(project)
    services.attempt_finish(project=project, rollout_id=attempt.rollout_id,
                            attempt_id=attempt.attempt_id, status="failed")
    with pytest.raises(IllegalTransition):
        services.attempt_finish(project=project, rollout_id=attempt.rollout_id,
                                attempt_id=attempt.attempt_id, status="succeeded",
                                usage=Usage(cpu_seconds=9))
    assert list(UsageEntry.objects.values_list("cpu_seconds", flat=True)) == [0.0]


@pytest.mark.django_db(transaction=True)
def test_a_late_report_after_the_watchdogs_verdict_writes_the_attempts_only_row(project):
    enqueue(project, config={"timeout_seconds": 1})
    _, attempt = claim(project)
    backdate(attempt, 60)
    watchdog.sweep()
    attempt.refresh_from_db()
    assert attempt.status == "timeout" and not UsageEntry.objects.exists()
    services.attempt_finish(project=project, rollout_id=attempt.rollout_id,
                            attempt_id=attempt.attempt_id, status="succeeded",
                            usage=Usage(cpu_seconds=4.0))
    assert list(UsageEntry.objects.values_list("cpu_seconds", flat=True)) == [4.0]


@pytest.mark.django_db(transaction=True)
def test_a_training_step_writes_its_row_with_its_finish_and_totals_are_shown(
        prices, monkeypatch, tmp_path, staff):
    prices.STORAGES = {**prices.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path)}}}
    prices.METRICS_TOKEN = "t"
    sent = capture_sends(monkeypatch)
    job = trainer_services.job_start(job_id=make_job(steps=1).pk)
    run_rollouts(job)
    step = job.steps.get(n=0)
    assert trainer_services.step_train(step_id=sent.train_steps.pop(), worker="w") == "done"
    step_row = UsageEntry.objects.get(kind="step")
    assert step_row.group_id == step.group_id and step_row.cpu_seconds > 0
    assert step_row.gpu_seconds == 0.0  # trained on the CPU
    attempts = UsageEntry.objects.filter(kind="attempt")
    # step 0's rollouts, each finished once (step 1's are queued: no verdict yet)
    assert attempts.count() == job.project.rollouts.filter(group_id=step.group_id).count() > 0
    assert {r.group_id for r in attempts} == {step.group_id}
    totals = trainer_selectors.job_usage(job=job)
    assert totals.rows == attempts.count() + 1
    assert totals.cost == pytest.approx(sum(r.cost for r in UsageEntry.objects.all()))
    out = io.StringIO()
    call_command("train_show", str(job.pk), stdout=out)
    assert f"cost: job {totals.describe()}" in out.getvalue()
    page = staff.get(f"/jobs/{job.pk}/").text
    assert f'<td class="job-cost">{totals.cost:.6f}</td>' in page
    admin_page = staff.get(f"/admin/trainer/trainingjob/{job.pk}/change/").text
    assert totals.describe() in admin_page
    project_page = staff.get(f"/admin/store/project/{job.project.pk}/change/").text
    assert selectors.usage_totals(project=job.project).describe() in project_page
    metrics = staff.get("/metrics").text
    samples = {(s.name, s.labels.get("project")): s.value
               for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert samples[("lightning_cost_total", job.project.name)] == pytest.approx(totals.cost)
    assert samples[("lightning_usage_cpu_seconds_total", job.project.name)] == pytest.approx(
        totals.cpu_seconds)


def _pool_cpu_seconds(pid: int) -> float:
    """CPU time of a Celery worker's pool processes (its children), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
            # utime, stime, cutime, cstime: fields 14-17 of proc(5), after the name
            total += sum(int(v) for v in fields[11:15]) / tick
    return total


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_attempt_cpu_seconds_reconcile_with_the_workers_own_cpu_accounting(
        project, broker_url, sending_to, celery_workers):
    """A real prefork worker runs agents that burn CPU; the ledger's CPU-seconds over the
    attempts add up to what its pool processes used (Linux /proc), within 2%."""
    worker = celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=2)
    before = _pool_cpu_seconds(worker.pid)
    runner_services.rollouts_enqueue_for_celery(
        project=project, specs=[RolloutSpec(input={"cpu_seconds": 0.6}) for _ in range(8)],
        agent="tests.celery_agents:burning_agent")
    wait_until(lambda: UsageEntry.objects.filter(project=project).count() == 8, timeout=180,
               message="the attempts did not all finish")
    wait_until(lambda: project.rollouts.filter(status="succeeded").count() == 8, timeout=30)
    used = _pool_cpu_seconds(worker.pid) - before
    charged = sum(UsageEntry.objects.filter(project=project).values_list("cpu_seconds",
                                                                        flat=True))
    print(f"ledger CPU-seconds {charged:.3f}, pool processes' CPU {used:.3f}")
    assert charged >= 8 * 0.6
    assert abs(charged - used) <= 0.02 * used, (charged, used)
