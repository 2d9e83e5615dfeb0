"""`manage.py train` and friends: on Postgres through call_command, and the embedded default
(SQLite, in-process workers) as a user runs it, in a subprocess, killed with SIGKILL midway."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from examples.cipher import job_spec
from store import services as store_services
from tests.celery_fixtures import wait_until
from trainer import services
from trainer.models import JobStatus, TrainingJob

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
    # The fair share (README "Scheduling"): step 0's rollouts queued in the job's party.
    assert ("share: weight 1, max concurrent rollouts none, 0 claimed" in out.getvalue()
            and f"job party trainer/job/{job.pk}: weight 1, usage 0.0" in out.getvalue())
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
@pytest.mark.parametrize("sig,returncode", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["ctrl-c", "sigterm"])
def test_an_interrupted_embedded_train_pauses_the_job_and_says_how_to_go_on(
        tmp_path, sig, returncode):
    """Finding 7: Ctrl+C printed a traceback and no resume hint, and the workers' rows stayed
    "alive"; SIGTERM (a container stopped, a `kill`) left the job `running`."""
    env = embedded_env(tmp_path)
    subprocess.run(manage("migrate", "-v0"), env=env, cwd=ROOT, check=True, timeout=300)
    run = subprocess.Popen(manage("train", "examples.cipher", "--steps", "4", "--quiet"),
                           env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        wait_until(lambda: len(done_steps(tmp_path / "lightning.sqlite3")) >= 1, timeout=240,
                   message="the embedded run did not finish a step")
        run.send_signal(sig)
        out, err = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == returncode, err[-3000:]
    assert "Traceback" not in err
    assert "job 1 paused; go on with `manage.py train_resume 1`" in err
    with sqlite3.connect(tmp_path / "lightning.sqlite3") as db:
        assert db.execute("SELECT status FROM trainer_trainingjob").fetchall() == [("paused",)]
        workers = db.execute("SELECT status FROM runners_celeryworker").fetchall()
    assert workers and set(workers) == {("stopped",)}


def test_no_follow_on_the_embedded_default_is_refused_not_ignored(settings, monkeypatch):
    """Finding 7: --no-follow was silently ignored on the embedded default."""
    settings.EMBEDDED_WORKERS = True
    monkeypatch.setattr(services, "job_start", lambda **kw: pytest.fail("started"))
    with pytest.raises(CommandError, match="--no-follow needs the distributed mode"):
        call_command("train", "examples.cipher", "--no-follow", "--steps", "1")


def test_hints_name_the_command_the_user_runs(monkeypatch):
    """Finding 7: hints printed `manage.py` to users of ./lightning."""
    from core.console import command_hint

    monkeypatch.delenv("LIGHTNING_COMMAND", raising=False)
    assert command_hint("train_resume 3") == "`manage.py train_resume 3`"
    monkeypatch.setenv("LIGHTNING_COMMAND", "./lightning")
    assert command_hint("train_resume 3") == "`./lightning train_resume 3`"
    script = (ROOT / "lightning").read_text()
    assert "LIGHTNING_COMMAND=./lightning exec .venv/bin/python manage.py" in script


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


def _spec(**changes) -> dict:
    spec = job_spec(steps=1)
    spec["val_dataset"] = spec["val_dataset"][:2]
    spec["config"] = {**spec["config"], **changes.pop("config", {})}
    spec.update(changes)
    return {k: v for k, v in spec.items() if v is not None}


def _without(spec: dict, *path: str) -> dict:
    if len(path) == 1:
        spec.pop(path[0])
    else:
        spec[path[0]].pop(path[1])
    return spec


BAD_SPECS = {
    "no_agent": (_without(_spec(), "agent"), "spec.json: the spec has no 'agent'"),
    "no_algorithm": (_without(_spec(), "algorithm"), "spec.json: the spec has no 'algorithm'"),
    "no_config": (_without(_spec(), "config"), "spec.json: the spec has no 'config'"),
    "no_policy": (_without(_spec(), "config", "policy"), "config.policy: missing"),
    "baseline_no_policy": (_without(_spec(algorithm="baseline"), "config", "policy"),
                           "config.policy: missing"),
    "policy_not_importable": (_spec(config={"policy": "nowhere.policy"}),
                              "config.policy: 'nowhere.policy' does not import"),
    "agent_not_a_string": (_spec(agent=3), "spec.json: 'agent' must be the agent's dotted path"),
    "dataset_not_a_list": (_spec(train_dataset="tasks.jsonl"),
                           "'train_dataset' must be a list of tasks, got str"),
    "config_not_an_object": (_spec() | {"config": [1]},
                             "'config' must be an object of the algorithm's settings, got list"),
    "not_an_object": ([1, 2], "spec.json: a job spec must be an object (a dict), got list"),
    "config_key_typo": (_spec(config={"lrr": 0.1}),
                        "config.lrr: unknown key (did you mean 'lr'?): neither the trainer nor "
                        "the algorithm 'grpo' reads it"),
    "another_algorithms_key": (_spec(config={"kl_coef": 0.1}),
                               "config.kl_coef: unknown key"),
    "agent_name_mistyped": (_spec(agent="examples.cipher.agent.cipher_agnet"),
                            "agent: agent 'examples.cipher.agent.cipher_agnet': "
                            "examples.cipher.agent has no 'cipher_agnet'"),
    "agent_not_on_path": (_spec(agent="myagents.math:agent"),
                          "agent: agent module 'myagents.math' cannot be imported: No module "
                          "named 'myagents' (is the directory holding it on PYTHONPATH here?"),
    "unknown_algorithm": (_spec(algorithm="gpro"),
                          "algorithm: unknown algorithm 'gpro': a built-in (grpo, baseline, "
                          "grpo_lm) or the dotted path of an Algorithm subclass"),
    "algorithm_module": (_spec(algorithm="examples.reinforce"),
                         "algorithm: 'examples.reinforce' is a module: name the Algorithm "
                         "class in it (examples.reinforce.REINFORCE)"),
}


@pytest.fixture
def no_sends(monkeypatch, settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path / "checkpoints")}}}
    monkeypatch.setattr(services.delivery, "send_rollouts", lambda *_: None)
    monkeypatch.setattr(services.delivery, "send_train_step", lambda *_: None)


def train_error(*args: str) -> str:
    with pytest.raises(CommandError) as raised:
        call_command("train", *args, "--no-follow", stdout=StringIO(), stderr=StringIO())
    message = str(raised.value)
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_a_bad_job_spec_is_one_line_and_creates_nothing(case, tmp_path, monkeypatch, no_sends):
    """Issue 26 finding 4: a missing `agent` or `policy` was a raw KeyError traceback, and one
    case (baseline without a policy) left a job `pending` forever."""
    spec, expected = BAD_SPECS[case]
    monkeypatch.chdir(tmp_path)
    Path("spec.json").write_text(json.dumps(spec, indent=1))
    assert expected in train_error("spec.json")
    assert not TrainingJob.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_spec_files_are_accepted_and_their_mistakes_named(tmp_path, monkeypatch, no_sends):
    monkeypatch.chdir(tmp_path)
    Path("spec.json").write_text(json.dumps(_spec()))
    out = StringIO()
    call_command("train", "spec.json", "--no-follow", "--steps", "2", stdout=out)
    job = TrainingJob.objects.get()
    assert (job.status, job.config["steps"], job.name) == (JobStatus.RUNNING, 2, "cipher")
    Path("myjob.py").write_text("from examples.cipher import job_spec\n")
    call_command("train", "myjob.py", "--no-follow", "--steps", "1", stdout=out)
    assert TrainingJob.objects.count() == 2
    Path("broken.json").write_text('{"agent": "a.b",\n "algorithm": grpo}\n')
    assert train_error("broken.json") == "broken.json:2: not JSON: Expecting value"
    assert "missing.json: cannot read the spec" in train_error("missing.json")
    Path("empty.py").write_text("x = 1\n")
    assert train_error("empty.py") == "empty.py: the file defines no job_spec() function"
    assert "names no job spec" in train_error("examples.nothing_here")
    Path("needs_more.py").write_text("import not_installed_pkg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert train_error("needs_more") == (
        "needs_more: importing it failed: No module named 'not_installed_pkg'")
    assert train_error("needs_more.py") == (
        "needs_more.py: loading it failed: ModuleNotFoundError(\"No module named "
        "'not_installed_pkg'\")")
    assert "expected KEY=JSON" in train_error("examples.cipher", "--set", "lr")
    # a mistyped setting is refused, not trained without (it was accepted and ignored)
    message = train_error("examples.cipher", "--set", "stpes=3", "--set", "lrr=0.1")
    assert message.startswith("config.lrr: unknown key (did you mean 'lr'?)")
    assert "also unknown: stpes" in message and "Known keys: " in message
    # a value that cannot work is refused too; `--steps 0` was taken as "the spec's default"
    assert train_error("examples.cipher", "--set", "val_every=0") == (
        "config.val_every: must be >= 1, got 0")
    assert "steps" in train_error("examples.cipher", "--steps", "0")
    assert TrainingJob.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_job_that_cannot_write_its_first_checkpoint_fails_instead_of_staying_pending(
    tmp_path, monkeypatch, no_sends
):
    monkeypatch.chdir(tmp_path)
    Path("spec.json").write_text(json.dumps(_spec(
        algorithm="baseline", config={"policy": "tests.trainer_specs.exploding_policy"})))
    assert "could not start: RuntimeError('no policy today')" in train_error("spec.json")
    job = TrainingJob.objects.get()
    assert job.status == JobStatus.FAILED and "no policy today" in job.error


@pytest.mark.django_db(transaction=True)
def test_train_parallel_and_resources_reach_the_job_config(no_sends):
    call_command("train", "examples.cipher", "--no-follow", "--steps", "1", "--world-size", "2",
                 "--parallel", "fsdp", "--set", 'resources={"gpus": 2, "gpu_memory_gb": 40}',
                 stdout=StringIO())
    job = TrainingJob.objects.get()
    assert (job.config["world_size"], job.config["parallel"], job.config["resources"]) == (
        2, "fsdp", {"gpus": 2, "gpu_memory_gb": 40})
    message = train_error("examples.cipher", "--set", 'resources={"gpu_type": ["A100", "H100"]}')
    assert "config.resources.gpu_type: one job's GPUs are one type" in message
    assert "mixed types are refused" in message
    assert TrainingJob.objects.count() == 1


def test_llm_serve_on_a_port_in_use_says_so_before_loading_anything():
    """It printed `model gateway on http://127.0.0.1:4748/v1`, loaded its models (30 s for
    SmolLM2 here), then uvicorn's `[Errno 98]`: agents went on calling whatever held the port
    (another deployment's gateway: `404 Rollout ... not found`)."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    port = held.getsockname()[1]
    out = StringIO()
    try:
        with pytest.raises(CommandError, match=rf"cannot listen on 127.0.0.1:{port}: .*in use.*"
                                               r"--port or LLM_GATEWAY_PORT"):
            call_command("llm_serve", "--port", str(port), "--model", "m=/nonexistent",
                         stdout=out)
    finally:
        held.close()
    assert "model gateway on" not in out.getvalue()
