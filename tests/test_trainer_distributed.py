"""A training step on world_size local ranks (DDP, trainer/distributed.py): the same update as
one process, a failing rank fails the try and leaves no process, the config's check, and jobs
through `manage.py train --world-size 2` (embedded) and real prefork Celery workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from examples.cipher import job_spec
from examples.cipher.task import act_samples
from store import services as store_services
from store.errors import InvalidInput
from tests.celery_fixtures import use_broker, wait_until
from tests.test_trainer_commands import ROOT, embedded_env, manage
from tests.trainer_algorithms import AbortsAfterUpdateGRPO, RankFailsGRPO
from trainer import distributed, services
from trainer.algorithms.grpo import GRPO
from trainer.models import JobStatus


def max_weight_difference(a: dict, b: dict) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)


@pytest.mark.slow
def test_world_size_2_update_equals_world_size_1():
    # 7 tasks x 5 episodes: an odd global batch, so the two shards differ in size (the loss
    # must be the mean over the global batch, not the mean of the shards' means).
    algorithm = GRPO(job_spec(seed=0)["config"])
    state = algorithm.init_state()
    samples = act_samples(state["model"], tasks=7, group_size=5, seed=4)
    one = algorithm.update(step=1, state=state, samples=samples, device="cpu")
    two, device = distributed.update(algorithm, step=1, state=state, samples=samples,
                                     world_size=2)
    assert one.metrics["trained_samples"] % 2 == 1
    difference = max_weight_difference(one.state["model"], two.state["model"])
    print(f"\nworld_size 2 vs 1, cipher MLP, {one.metrics['trained_samples']} samples x "
          f"{algorithm.config['epochs']} epochs: max abs weight difference {difference:.3g}")
    assert difference < 1e-5
    assert device == "cpu x2"
    assert max_weight_difference(one.state["model"], state["model"]) > 1e-3  # it did train
    assert two.metrics["loss"] == pytest.approx(one.metrics["loss"], abs=1e-5)
    assert two.metrics["clip_fraction"] == pytest.approx(one.metrics["clip_fraction"])


@pytest.mark.slow
def test_a_rank_that_raises_fails_the_update_with_its_error_and_no_rank_is_left(tmp_path):
    algorithm = RankFailsGRPO({**job_spec(seed=0)["config"], "pid_dir": str(tmp_path),
                               "fail_rank": 1})
    state = algorithm.init_state()
    samples = act_samples(state["model"], tasks=2, group_size=4, seed=1)

    def spawned() -> set[int]:  # spawn children (earlier tests of the session may hold some)
        return {p.pid for p in psutil.Process().children(recursive=True)
                if "spawn_main" in " ".join(p.cmdline())}

    before = spawned()
    with pytest.raises(distributed.RankFailed, match="rank 1 of 2 failed") as failure:
        distributed.update(algorithm, step=0, state=state, samples=samples, world_size=2)
    assert "RuntimeError: rank 1 broke on purpose" in str(failure.value)
    pids = [int((tmp_path / f"rank{rank}").read_text()) for rank in (0, 1)]
    # Rank 0 was waiting in the all-reduce for rank 1: it was stopped and reaped too.
    assert not [pid for pid in pids if psutil.pid_exists(pid)]
    # (multiprocessing's one resource tracker may stay: it is not a rank)
    assert spawned() - before == set()


@pytest.mark.slow
def test_a_rank_dying_after_the_update_is_complete_does_not_fail_it():
    """CI saw a rank abort in its teardown ('terminate called without an active exception')
    after the update was complete: rank 0's saved update is used, with a warning."""
    config = job_spec(seed=0)["config"]
    state = GRPO(config).init_state()
    samples = act_samples(state["model"], tasks=2, group_size=4, seed=1)
    update, device = distributed.update(AbortsAfterUpdateGRPO(config), step=0, state=state,
                                        samples=samples, world_size=2)
    assert device == "cpu x2" and update.state is not None


def rank_pids(pid_dir: Path, count: int = 2) -> list[int]:
    wait_until(lambda: len(list(pid_dir.iterdir())) == count, timeout=120,
               message="the ranks did not start")
    return [int((pid_dir / f"rank{rank}").read_text()) for rank in range(count)]


@pytest.mark.slow
def test_a_rank_killed_with_sigkill_fails_the_update_and_stops_the_others(tmp_path):
    algorithm = RankFailsGRPO({**job_spec(seed=0)["config"], "pid_dir": str(tmp_path),
                               "fail_rank": 1, "hang": True})
    state = algorithm.init_state()
    samples = act_samples(state["model"], tasks=2, group_size=4, seed=1)
    killer = threading.Thread(target=lambda: os.kill(rank_pids(tmp_path)[1], signal.SIGKILL))
    killer.start()
    with pytest.raises(distributed.RankFailed, match="rank 1 of 2 failed: process 1 "
                                                     "terminated with signal SIGKILL"):
        distributed.update(algorithm, step=0, state=state, samples=samples, world_size=2)
    killer.join()
    assert not [pid for pid in rank_pids(tmp_path) if psutil.pid_exists(pid)]


KILLED_WORKER = """
import sys
from examples.cipher import job_spec
from examples.cipher.task import act_samples
from tests.trainer_algorithms import RankFailsGRPO
from trainer import distributed
if __name__ == "__main__":
    algorithm = RankFailsGRPO({**job_spec(seed=0)["config"], "pid_dir": sys.argv[1],
                               "fail_rank": 1, "hang": True})
    state = algorithm.init_state()
    samples = act_samples(state["model"], tasks=2, group_size=4, seed=1)
    distributed.update(algorithm, step=0, state=state, samples=samples, world_size=2)
"""


@pytest.mark.slow
def test_the_ranks_die_with_a_worker_killed_with_sigkill(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(KILLED_WORKER)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    worker = subprocess.Popen([sys.executable, str(script), str(pid_dir)], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        pids = rank_pids(pid_dir)
        worker.kill()
        worker.wait(timeout=30)
        wait_until(lambda: not [pid for pid in pids if psutil.pid_exists(pid)
                                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE],
                   timeout=30, message=f"ranks {pids} outlived their worker")
    finally:
        worker.kill()


@pytest.mark.django_db
@pytest.mark.parametrize("value", [0, -1, "2", True, 1.5, 65])
def test_world_size_must_be_a_small_positive_integer(value):
    spec = job_spec(steps=1)
    with pytest.raises(InvalidInput, match="config.world_size: must be an integer from 1 to 64"):
        services.job_create(project=store_services.project_create(name="ws"),
                            agent=spec["agent"], algorithm="grpo",
                            config={**spec["config"], "world_size": value},
                            train_dataset=spec["train_dataset"])


@pytest.mark.django_db
def test_an_algorithm_without_ddp_refuses_world_size_2():
    spec = job_spec(steps=1)
    with pytest.raises(InvalidInput, match="Baseline trains in one process only; world_size"):
        services.job_create(project=store_services.project_create(name="ws"),
                            agent=spec["agent"], algorithm="baseline",
                            config={**spec["config"], "world_size": 2},
                            train_dataset=spec["train_dataset"])


LOAD_AT_WORLD_SIZE_1 = """
import json
from examples.cipher.task import act_samples
from trainer import selectors, services
from trainer.algorithms import algorithm_load
from trainer.checkpoints import find_checkpoint
from trainer.models import TrainingJob
job = TrainingJob.objects.get()
algorithm = algorithm_load(job.algorithm, {**services.job_config(job), "world_size": 1})
out = {"config": job.config["world_size"], "status": job.status,
       "devices": [s.device for s in job.steps.order_by("n")], "loaded": []}
for version in selectors.job_checkpoints(job=job):
    state = algorithm.load(find_checkpoint(version.resources))
    samples = act_samples(state["model"], tasks=2, group_size=4, seed=5)
    update = algorithm.update(step=9, state=state, samples=samples, device="cpu")
    out["loaded"].append([version.version, update.metrics["trained_samples"]])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_embedded_train_with_world_size_2_runs_and_its_checkpoints_load_at_1(tmp_path):
    env = embedded_env(tmp_path)
    subprocess.run(manage("migrate", "-v0"), env=env, cwd=ROOT, check=True, timeout=300)
    run = subprocess.run(
        manage("train", "examples.cipher", "--world-size", "2", "--steps", "2", "--quiet",
               "--set", "tasks_per_step=4", "--set", "group_size=4"),
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "succeeded" in run.stdout
    shown = subprocess.run(manage("shell", "-c", LOAD_AT_WORLD_SIZE_1), env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    out = json.loads(shown.stdout.strip().splitlines()[-1])
    assert out["config"] == 2 and out["status"] == "succeeded"
    # Steps 0 and 1 trained on two ranks; step 2 only evaluates (no update, the worker's own).
    assert out["devices"][:2] == ["cpu x2", "cpu x2"]
    # Checkpoint 0 and one per training step, each loaded and trained on in one process.
    assert [version for version, _ in out["loaded"]] == [1, 2, 3]
    assert all(trained >= 0 for _, trained in out["loaded"])


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_prefork_celery_worker_runs_a_world_size_2_step(rabbitmq_url, celery_workers,
                                                        tmp_path, settings):
    """The deployment's training worker is a prefork child (billiard): it starts the ranks."""
    path = tmp_path / "checkpoints"
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(path)}}}
    env = {"CHECKPOINT_DIR": str(path)}
    celery_workers(queues=["rollouts"], broker_url=rabbitmq_url, concurrency=2, env=env)
    celery_workers(queues=["training"], broker_url=rabbitmq_url, concurrency=1, env=env)
    spec = job_spec(seed=1, steps=1)
    with use_broker(rabbitmq_url):
        job = services.job_create(
            project=store_services.project_create(name="ddp-celery"), agent=spec["agent"],
            algorithm="grpo", train_dataset=spec["train_dataset"],
            val_dataset=spec["val_dataset"][:4],
            config={**spec["config"], "tasks_per_step": 2, "group_size": 4, "world_size": 2})
        services.job_start(job_id=job.pk)

        def finished() -> bool:
            services.steps_sweep()
            job.refresh_from_db()
            return job.status in (JobStatus.SUCCEEDED, JobStatus.FAILED)

        wait_until(finished, timeout=300, message="the world_size 2 job did not finish")
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert job.steps.get(n=0).device == "cpu x2"


@pytest.mark.slow
@pytest.mark.django_db
def test_fsdp_world_size_2_checkpoint_loads_at_world_size_1_with_the_same_update(
        settings, tmp_path):
    """parallel: fsdp shards the cipher MLP with FSDP2 (fully_shard, gloo on the CPU); the
    ranks write the new state with torch.distributed.checkpoint; stored as the step's
    checkpoint, it loads in one process (a world_size=1 step, an agent) and equals one
    process's update; the next step trains from it at world size 1 and 2 alike."""
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path)}}}
    algorithm = GRPO({**job_spec(seed=0)["config"], "parallel": "fsdp"})
    state = algorithm.init_state()
    samples = act_samples(state["model"], tasks=7, group_size=5, seed=4)
    one = algorithm.update(step=1, state=state, samples=samples, device="cpu")
    two, device = distributed.update(algorithm, step=1, state=state, samples=samples,
                                     world_size=2, parallel="fsdp")
    assert device == "cpu x2" and set(two.state) == {"dcp"}
    sharded_dir = two.state["dcp"]
    resource = algorithm.save(two.state, name_prefix="jobs/fsdp", step=2)
    assert not os.path.exists(sharded_dir)  # stored, then removed
    assert resource["format"] == "hf-dir" and ".metadata" in resource["files"]
    assert sum(name.endswith(".distcp") for name in resource["files"]) == 2  # a shard a rank
    loaded = GRPO(job_spec(seed=0)["config"]).load(resource)  # a world_size=1 job's load
    difference = max_weight_difference(one.state["model"], loaded["model"])
    print(f"\nworld_size 2 (FSDP2, gloo) vs 1, cipher MLP, {one.metrics['trained_samples']} "
          f"samples: max abs weight difference {difference:.3g}")
    assert difference < 1e-4
    assert two.metrics["loss"] == pytest.approx(one.metrics["loss"], abs=1e-5)
    # The optimizer's state came through too: the next step from either checkpoint agrees.
    more = act_samples(one.state["model"], tasks=3, group_size=4, seed=9)
    after_one = algorithm.update(step=2, state=one.state, samples=more, device="cpu")
    after_two = algorithm.update(step=2, state=loaded, samples=more, device="cpu")
    assert max_weight_difference(after_one.state["model"], after_two.state["model"]) < 1e-4
    sharded, _ = distributed.update(algorithm, step=2, state=loaded, samples=more,
                                    world_size=2, parallel="fsdp")
    after_sharded = algorithm.load(algorithm.save(sharded.state, name_prefix="jobs/fsdp",
                                                  step=3))
    assert max_weight_difference(after_one.state["model"], after_sharded["model"]) < 1e-4


@pytest.mark.django_db
def test_parallel_must_be_ddp_or_fsdp_and_fsdp_needs_an_algorithm_that_shards():
    spec = job_spec(steps=1)
    project = store_services.project_create(name="par")
    with pytest.raises(InvalidInput, match="config.parallel: must be one of ddp, fsdp"):
        services.job_create(project=project, agent=spec["agent"], algorithm="grpo",
                            config={**spec["config"], "parallel": "zero3"},
                            train_dataset=spec["train_dataset"])
    with pytest.raises(InvalidInput, match="config.parallel: GRPOLM does not shard"):
        services.job_create(project=project, agent=spec["agent"], algorithm="grpo_lm",
                            config={"model": "examples/none", "parallel": "fsdp"},
                            train_dataset=spec["train_dataset"])
