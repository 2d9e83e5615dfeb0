"""`manage.py train` and friends: on Postgres through call_command, and the embedded default
(SQLite, in-process workers) as a user runs it, in a subprocess, killed with SIGKILL midway."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command

from examples.cipher import job_spec
from store import services as store_services
from tests.celery_fixtures import wait_until
from trainer import services
from trainer.models import JobStatus

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.django_db(transaction=True)
def test_train_show_and_train_cancel(monkeypatch, settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path)}}}
    monkeypatch.setattr(services.delivery, "send_rollouts", lambda *_: None)
    spec = job_spec(steps=2)
    job = services.job_create(
        project=store_services.project_create(name="cmd"), agent=spec["agent"],
        algorithm="grpo", config=spec["config"], train_dataset=spec["train_dataset"],
        name="cipher",
    )
    services.job_start(job_id=job.pk)
    out = StringIO()
    call_command("train_show", str(job.pk), stdout=out)
    assert f"job {job.pk} cipher [running]" in out.getvalue()
    assert "step   0  rolling" in out.getvalue()
    call_command("train_cancel", str(job.pk), stdout=out)
    job.refresh_from_db()
    assert job.status == JobStatus.CANCELLED


def embedded_env(data_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE")}
    return {**env, "LIGHTNING_DATA_DIR": str(data_dir), "LOG_LEVEL": "WARNING"}


def manage(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "manage.py"), *args]


def done_steps(db: Path) -> list[int]:
    if not db.exists():
        return []
    with sqlite3.connect(db, timeout=30) as conn:
        try:
            rows = conn.execute("SELECT n FROM trainer_trainingstep WHERE status='done'")
        except sqlite3.OperationalError:  # tables not there yet
            return []
        return sorted(n for (n,) in rows)


@pytest.mark.slow
def test_embedded_train_killed_midway_resumes_from_its_last_finished_step(tmp_path):
    env = embedded_env(tmp_path)
    subprocess.run(manage("migrate", "-v0"), env=env, cwd=ROOT, check=True, timeout=300)
    run = subprocess.Popen(manage("train", "examples.cipher", "--steps", "4", "--quiet"),
                           env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: len(done_steps(tmp_path / "lightning.sqlite3")) >= 2, timeout=240,
                   message="the embedded run did not finish two steps")
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(timeout=30)
    before = done_steps(tmp_path / "lightning.sqlite3")
    assert before[:2] == [0, 1] and 4 not in before
    resumed = subprocess.run(manage("train_resume", "1", "--quiet"), env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "job 1: succeeded" in resumed.stdout
    assert "threshold 0.9" in resumed.stdout
    assert done_steps(tmp_path / "lightning.sqlite3") == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_ctrl_c_on_embedded_train_pauses_the_job_and_says_how_to_go_on(tmp_path):
    """Finding 7: Ctrl+C printed a traceback and no resume hint; the workers' rows stayed
    "alive"."""
    env = embedded_env(tmp_path)
    subprocess.run(manage("migrate", "-v0"), env=env, cwd=ROOT, check=True, timeout=300)
    run = subprocess.Popen(manage("train", "examples.cipher", "--steps", "4", "--quiet"),
                           env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        wait_until(lambda: len(done_steps(tmp_path / "lightning.sqlite3")) >= 1, timeout=240,
                   message="the embedded run did not finish a step")
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert "job 1 paused; go on with `manage.py train_resume 1`" in err
    with sqlite3.connect(tmp_path / "lightning.sqlite3") as db:
        assert db.execute("SELECT status FROM trainer_trainingjob").fetchall() == [("paused",)]
        workers = db.execute("SELECT status FROM runners_celeryworker").fetchall()
    assert workers and set(workers) == {("stopped",)}


@pytest.mark.slow
def test_embedded_baseline_whose_rollouts_all_fail_exits_non_zero_with_the_first_error(tmp_path):
    """Issue 26 finding 2: an evaluation-only job whose rollouts all failed ended `succeeded`,
    rc 0."""
    env = embedded_env(tmp_path)
    subprocess.run(manage("migrate", "-v0"), env=env, cwd=ROOT, check=True, timeout=300)
    run = subprocess.run(manage("train", "tests.trainer_specs.broken_baseline_spec", "--quiet",
                                "--set", "max_step_attempts=1"),
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "job 1: failed" in run.stdout
    assert "4 of 4 validation rollouts failed" in run.stdout
    assert "the broken agent fails every rollout" in run.stdout
    assert "job 1 failed" in run.stderr
