"""Commands' output: quiet (no library warnings or log lines), progress and summaries on
stdout with the mean reward, `train_list`, and a bad setting named without a traceback."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from io import StringIO

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command

from core.console import quiet_libraries
from core.env import database_from_url
from examples.cipher import job_spec
from runners.management.commands._progress import reward_line
from store import services as store_services
from store.models import Attempt
from store.rewards import REWARD_ANNOTATION_SPAN, REWARD_LEGACY_SPAN
from tests.api.conftest import ROOT
from tests.conftest import claim, enqueue
from tests.test_span_services import span
from trainer import services
from trainer.models import JobStatus, TrainingJob

AGENT = "tests.celery_agents:ok_agent"


def _embedded(data_dir, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE")}
    return subprocess.run([str(ROOT / "lightning"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**env, "LIGHTNING_DATA_DIR": str(data_dir)})


@pytest.mark.slow
def test_an_embedded_batch_prints_progress_and_mean_reward_on_stdout_and_nothing_else(tmp_path):
    result = _embedded(tmp_path, "rollouts_enqueue", "quiet", "--create-project",
                       "--agent", AGENT, "--input", '{"i": 0.5}', "--count", "6")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no numpy, kombu or Celery lines
    assert "enqueued 6 rollouts" in result.stdout and "6/6" in result.stdout  # the bar
    assert "mean reward: 0.500 over 6 of 6 rollouts" in result.stdout


def test_a_bad_database_url_option_is_named_without_a_traceback(tmp_path):
    with pytest.raises(ImproperlyConfigured, match="DATABASE_URL option conn_max_age"):
        database_from_url("postgres://u@h/db?conn_max_age=soon")
    env = {**os.environ, "DATABASE_URL": "postgres://u@127.0.0.1/db?conn_max_age=soon",
           "DJANGO_SECRET_KEY": "x"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    result = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: DATABASE_URL option conn_max_age must be a whole "
                                     "number of seconds, not 'soon'")


def test_libraries_log_warnings_only_unless_asked_for_detail():
    quiet_libraries(1)
    assert logging.getLogger("celery").getEffectiveLevel() == logging.WARNING
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING
    quiet_libraries(2)
    assert logging.getLogger("celery.worker").getEffectiveLevel() == logging.INFO
    quiet_libraries(1)


@pytest.mark.django_db
def test_the_mean_reward_reads_the_last_reward_span_of_the_latest_attempt(project):
    rewarded, legacy, silent = enqueue(project, 3)
    for rollout, name, attributes in (
            (rewarded, REWARD_ANNOTATION_SPAN, {"agentlightning.reward.0.value": 0.25}),
            (legacy, REWARD_LEGACY_SPAN, {"reward": 0.75})):
        claimed, attempt = claim(project)
        assert claimed.pk == rollout.pk
        first = {k: v * 10 for k, v in attributes.items()}  # overwritten by the last one
        for n, value in ((1, first), (2, attributes)):
            store_services.span_add(project=project, span=span(rollout, attempt, n,
                                                               name=name, attributes=value))
    assert reward_line([rewarded.pk, legacy.pk, silent.pk]) == \
        "mean reward: 0.500 over 2 of 3 rollouts"
    assert reward_line([silent.pk]) == "mean reward: - (none of the 1 rollouts recorded a reward)"
    assert Attempt.objects.count() == 2


@pytest.mark.django_db
def test_train_list_shows_jobs_newest_first_with_status_steps_and_best_reward():
    assert _train_list() == "no training jobs\n"
    project = store_services.project_create(name="listed")
    spec = job_spec(seed=0, steps=3)
    jobs = [services.job_create(project=project, agent=spec["agent"], algorithm="grpo",
                                config=spec["config"], train_dataset=spec["train_dataset"],
                                name=f"cipher{i}") for i in range(2)]
    TrainingJob.objects.filter(pk=jobs[0].pk).update(
        status=JobStatus.SUCCEEDED, best_metric=0.8125, best_version=3)
    lines = _train_list().splitlines()
    assert lines[0].split()[:5] == ["job", "status", "steps", "best", "checkpoint"]
    assert lines[1].split()[:2] == [str(jobs[1].pk), "pending"]
    assert lines[2].split()[:5] == [str(jobs[0].pk), "succeeded", "0/4", "0.812", "v3"]
    assert lines[2].endswith("listed/cipher0")
    assert _train_list("--status", "succeeded").count("\n") == 2
    assert _train_list("--project", "nope") == "no training jobs\n"


def _train_list(*args: str) -> str:
    out = StringIO()
    call_command("train_list", *args, stdout=out)
    return out.getvalue()


BROKEN_JOB = '''
from examples.cipher import job_spec as cipher


def broken_agent(task, **kwargs):
    raise RuntimeError("this agent is broken")


def job_spec(**kwargs):
    spec = cipher(**kwargs)
    spec["agent"] = "brokenjob.broken_agent"
    spec["config"].update(tasks_per_step=3, group_size=2)
    return spec
'''


@pytest.mark.slow
def test_a_broken_agent_in_an_embedded_train_is_said_once_not_per_rollout(tmp_path):
    (tmp_path / "brokenjob.py").write_text(BROKEN_JOB)
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE",
                        "LOG_LEVEL")}
    env.update(LIGHTNING_DATA_DIR=str(tmp_path / "data"), PYTHONPATH=str(tmp_path))
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env,
                   check=True, timeout=300)
    result = subprocess.run([sys.executable, "manage.py", "train", "brokenjob", "--steps", "1"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1
    # 3 tries x 6 rollouts failed; the first is said once, the summary says the rest.
    failures = [line for line in result.stderr.splitlines() if "this agent is broken" in line]
    assert len(failures) == 1, result.stderr
    assert len(result.stderr.splitlines()) <= 5, result.stderr
    assert "6 of 6 train rollouts failed" in result.stdout
    assert 'raise RuntimeError("this agent is broken")' in result.stdout  # the first traceback


def test_routine_control_tasks_log_at_debug_only(caplog):
    """The sweep every 5 s made an idle control worker log ~1,400 lines an hour."""
    import celery.app.trace as trace

    import core.celery  # noqa: F401 - installs the filter

    def succeeded(name: str) -> None:
        trace.logger.info(trace.LOG_SUCCESS, {"id": "1", "name": name, "runtime": 0.01,
                                              "return_value": "{}"})

    def received(name: str) -> None:
        logging.getLogger("celery.worker.strategy").info(
            trace.LOG_RECEIVED, {"id": "1", "name": name, "args": "()", "kwargs": "{}",
                                 "eta": None})

    loggers = [trace.logger, logging.getLogger("celery.worker.strategy")]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    try:
        for lg in loggers:  # as a worker run with -l INFO has them (other tests quiet them)
            lg.setLevel(logging.INFO)
            lg.propagate = True
        with caplog.at_level(logging.INFO):
            for name in ("runners.sweep", "runners.reconcile", "runners.run_rollout"):
                succeeded(name)
                received(name)
        assert [r.getMessage().split("[")[0] for r in caplog.records] == [
            "Task runners.run_rollout", "Task runners.run_rollout"]
        caplog.clear()
        trace.logger.setLevel(logging.DEBUG)
        with caplog.at_level(logging.DEBUG):
            succeeded("runners.sweep")
        assert len(caplog.records) == 1
    finally:
        for lg, (level, propagate) in zip(loggers, saved, strict=True):
            lg.setLevel(level)
            lg.propagate = propagate
