"""The runners' commands, settings checks and the reconciler registry."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command

from core import control
from runners import services
from runners.checks import check_settings
from store.models import Span
from store.services import RolloutSpec


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_rollouts_enqueue_waits_for_the_batch_and_queue_watch_reports_it(
    project, broker_url, sending_to, celery_workers
):
    celery_workers(queues=["rollouts"], broker_url=broker_url, name="cmd")
    out = StringIO()
    call_command("rollouts_enqueue", project.name, "--agent", "tests.celery_agents:ok_agent",
                 "--input", '{"i": 4}', "--count", "5", "--wait", "--wait-timeout", "120",
                 stdout=out, stderr=StringIO())
    assert json.loads(out.getvalue().splitlines()[-1]) == {"succeeded": 5}
    assert Span.objects.filter(rollout__project=project).count() == 20
    out = StringIO()
    call_command("queue_watch", project.name, "--once", stdout=out)
    text = out.getvalue()
    assert "queue rollouts: cmd@" in text
    assert "queue training: - (waiting: no live worker serves queue 'training')" in text
    assert "succeeded=5" in text


@pytest.mark.django_db
def test_queue_watch_says_why_celery_rollouts_wait(project, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks():
        services.rollouts_enqueue_for_celery(
            project=project, specs=[RolloutSpec(input=1)], agent="tests.celery_agents:ok_agent"
        )
    out = StringIO()
    call_command("queue_watch", project.name, "--once", stdout=out)
    assert "queuing=1 | live workers: 0 | waiting: no live worker serves queue 'rollouts'" in (
        out.getvalue()
    )


def test_settings_that_contradict_each_other_are_reported(settings):
    settings.RUNNERS_HEARTBEAT_SECONDS = 30
    settings.RUNNERS_DEFAULT_UNRESPONSIVE_SECONDS = 45
    settings.WORKERS_HEARTBEAT_SECONDS = 40
    settings.WORKERS_LOST_AFTER_SECONDS = 60
    settings.SCALE_TRAINING_MIN_WORKERS = 5  # above SCALE_TRAINING_MAX_WORKERS (4)
    # E004: STORE_SILENT_WORKER_SECONDS (20) within two 30 s heartbeats.
    assert [p.id for p in check_settings()] == ["runners.E001", "runners.E004", "runners.E002",
                                                "runners.E003"]
    settings.RUNNERS_DEFAULT_UNRESPONSIVE_SECONDS = 0  # no default limit: nothing to check
    settings.STORE_SILENT_WORKER_SECONDS = 61
    settings.WORKERS_LOST_AFTER_SECONDS = 120
    settings.SCALE_TRAINING_MIN_WORKERS = 4
    assert check_settings() == []


def test_a_failing_reconciler_does_not_stop_the_others():
    def broken() -> int:
        raise RuntimeError("bug")

    control.register_reconciler("test_broken", broken)
    control.register_reconciler("test_ok", lambda: 3)
    try:
        counts = control.run_reconcilers()
    finally:
        control.unregister_reconciler("test_broken")
        control.unregister_reconciler("test_ok")
    assert counts["test_broken"] == -1 and counts["test_ok"] == 3


@pytest.mark.django_db
def test_a_mistyped_agent_path_is_refused_when_enqueuing(project):
    """Finding 5: a mistyped agent path was accepted and failed every rollout."""
    from django.core.management.base import CommandError

    from store.errors import InvalidInput

    with pytest.raises(InvalidInput, match="no_such_agent"):
        services.rollouts_enqueue_for_celery(
            project=project, specs=[RolloutSpec(input=1)], agent="tests.celery_agents:no_such_agent"
        )
    with pytest.raises(CommandError, match="cannot be imported"):
        call_command("rollouts_enqueue", project.name, "--agent", "tests.celery_agnets:ok_agent",
                     stdout=StringIO())
    assert not project.rollouts.exists()


@pytest.mark.django_db(transaction=True)
def test_rollouts_enqueue_exits_non_zero_with_the_first_error_when_rollouts_failed(
    project, settings, monkeypatch
):
    """Finding 5: `rollouts_enqueue` exited 0 with {"failed": 50}. The batch runs here, in
    this process (the embedded workers' own path), by sending each rollout to rollout_run."""
    from django.core.management.base import CommandError

    def run_here(dispatches):
        for d in dispatches:
            with pytest.raises(services.RolloutFailed, match="ValueError: bad input"):
                services.rollout_run(project_id=d.project_id, rollout_id=d.rollout_id,
                                     worker_id="here")

    monkeypatch.setattr(services, "dispatches_send", run_here)
    settings.EMBEDDED_WORKERS = False
    out = StringIO()
    with pytest.raises(CommandError) as raised:
        call_command("rollouts_enqueue", project.name, "--agent",
                     "tests.celery_agents:failing_agent", "--count", "3", "--wait",
                     "--wait-timeout", "30",
                     stdout=out, stderr=StringIO())
    assert json.loads(out.getvalue().splitlines()[-1]) == {"failed": 3}
    assert "3 of 3 rollouts failed" in str(raised.value)
    # the exception first (the traceback below it): not a screen of frames to scroll back over
    assert ": ValueError: bad input" in str(raised.value).splitlines()[0]
    assert "Traceback (most recent call last)" in str(raised.value)


@pytest.mark.django_db(transaction=True)
def test_an_agent_that_requires_a_resource_nothing_pins_is_refused_then_said_plainly(
    project, settings, monkeypatch
):
    """The README's agent (`def agent(task, llm, rollout)`) enqueued without `--llm` failed
    every rollout with `TypeError: agent() missing 1 required positional argument: 'llm'`."""
    from django.core.management.base import CommandError

    from runners.agent import AgentError, RolloutInfo, call_agent, load_agent

    settings.EMBEDDED_WORKERS = False
    with pytest.raises(CommandError, match=r"requires 'llm', but the rollout pins no resource "
                                           r"of that name \(its resources: none\).*--llm"):
        call_command("rollouts_enqueue", project.name, "--agent",
                     "tests.celery_agents:llm_agent", stdout=StringIO())
    assert not project.rollouts.exists()
    # with the resource pinned, it is enqueued
    monkeypatch.setattr(services, "dispatches_send", lambda dispatches: None)
    call_command("rollouts_enqueue", project.name, "--agent", "tests.celery_agents:llm_agent",
                 "--resource", 'llm={"resource_type": "llm", "endpoint": "http://x"}',
                 stdout=StringIO())
    assert project.rollouts.count() == 1
    # a rollout that reaches a worker without it fails saying why, not with a TypeError
    info = RolloutInfo(rollout_id="ro-1", attempt_id="at-1")
    with pytest.raises(AgentError, match=r"requires 'llm'.*its resources: checkpoint"):
        call_agent(load_agent("tests.celery_agents:llm_agent"), task={},
                   resources={"checkpoint": {}}, rollout=info)
