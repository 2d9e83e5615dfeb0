"""A step across nodes (trainer/gang.py): a gang of training workers x local ranks meeting at
rows of the store and node 0's TCPStore on 127.0.0.1. The rendezvous rows on Postgres (all or
nothing, release), and real prefork Celery training workers (2 x 2 gloo ranks): a missing node
makes the step wait with the reason, the gang's update equals world size 1's, and kill -9 of
one member fails the try everywhere and the step is redone with versions gapless."""

from __future__ import annotations

import os
import signal
import socket
from datetime import timedelta
from io import StringIO

import psutil
import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from core.retry import DEFAULT as DB_RETRY
from core.usage import CpuMeter
from examples.cipher import job_spec
from store import selectors as store_selectors
from store import services as store_services
from store.errors import InvalidInput
from store.models import Rollout, UsageEntry
from store.statemachine import RolloutStatus
from tests.celery_fixtures import use_broker, wait_until
from trainer import gang, selectors, services
from trainer.algorithms import algorithm_load
from trainer.checkpoints import find_checkpoint
from trainer.models import GangMember, JobStatus, StepStatus, TrainingJob, TrainingStep


def max_weight_difference(a: dict, b: dict) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def gang_job(name: str, **config):
    spec = job_spec(seed=1, steps=1)
    return services.job_create(
        project=store_services.project_create(name=name), agent=spec["agent"],
        algorithm=config.pop("algorithm", "grpo"), train_dataset=spec["train_dataset"],
        val_dataset=spec["val_dataset"][:4],
        config={**spec["config"], "tasks_per_step": 2, "group_size": 4, "world_size": 4,
                "nodes": 2, "resend_seconds": 2, **config})


@pytest.mark.django_db
@pytest.mark.parametrize(("config", "message"), [
    ({"nodes": 0}, "config.nodes: must be an integer from 1 to 16"),
    ({"nodes": 2, "world_size": 3}, "world_size=3 must be a multiple of nodes=2"),
    ({"nodes": 2, "world_size": 4, "parallel": "fsdp"}, "a gang across nodes runs DDP only"),
    ({"nodes": 2, "world_size": 4, "max_staleness": 1}, "with max_staleness, set consume: step"),
])
def test_nodes_must_divide_world_size_and_run_ddp(config, message):
    spec = job_spec(steps=1)
    with pytest.raises(InvalidInput, match=message):
        services.job_create(project=store_services.project_create(name="gang-config"),
                            agent=spec["agent"], algorithm="grpo",
                            config={**spec["config"], **config},
                            train_dataset=spec["train_dataset"])


@pytest.mark.django_db
def test_a_gang_starts_only_when_every_node_joined_and_a_lone_member_gives_its_place_back(
        admin_client):
    job = gang_job("gang-rows")
    services.job_start(job_id=job.pk)
    step = job.steps.get(n=0)
    TrainingStep.objects.filter(pk=step.pk).update(status=StepStatus.READY)
    workers = [("training-a@h", []), ("training-b@h", [])]

    first = gang.gang_join(step_id=step.pk, worker="celery:training-a@h:11")
    assert first is not None and first.node_rank == 0 and first.attempt == 1
    assert gang.gang_join(step_id=step.pk, worker="celery:training-a@h:11") is None  # twice
    gang.gang_master_set(addr="127.0.0.1", member_id=first.pk, port=29555, backend="gloo")
    assert gang.gang_start(member_id=first.pk) == "waiting"  # one node missing: nothing starts
    step.refresh_from_db()
    assert (step.status, step.attempts) == (StepStatus.READY, 0)
    reason = selectors.step_waiting_reason(step=step, workers=workers[:1])
    print(f"\nwaiting: {reason}")
    assert reason == ("gang of 2 training workers: 1 joined (celery:training-a@h:11), waiting "
                      "for 1 more; live training workers that fit: 1 (training-a@h)")
    # Where operators look (the registry here has no live worker):
    shown = "gang of 2 training workers: 1 joined (celery:training-a@h:11), waiting for 1 more"
    out = StringIO()
    call_command("train_show", str(job.pk), stdout=out)
    assert f"waiting: {shown}" in out.getvalue()
    out = StringIO()
    call_command("queue_watch", "gang-rows", "--once", stdout=out)
    assert f"training step 0 of job {job.pk}: waiting: {shown}" in out.getvalue()
    assert shown in admin_client.get(f"/jobs/{job.pk}/").content.decode()

    assert gang.gang_release(member_id=first.pk)  # the bounded wait ran out: it leaves
    assert not GangMember.objects.filter(step=step).exists()
    assert selectors.step_waiting_reason(step=step, workers=workers[:1]) == (
        "needs a gang of 2 training workers; live training workers that fit: 1 (training-a@h)")
    assert selectors.step_waiting_reason(step=step, workers=workers) is None

    b = gang.gang_join(step_id=step.pk, worker="celery:training-b@h:22")
    a = gang.gang_join(step_id=step.pk, worker="celery:training-a@h:11")
    assert (b.node_rank, a.node_rank) == (0, 1)  # the smallest free rank, first come
    assert gang.gang_join(step_id=step.pk, worker="celery:training-c@h:33") is None  # full
    assert gang.gang_start(member_id=a.pk) == "waiting"  # node 0 has no address yet
    gang.gang_master_set(addr="127.0.0.1", member_id=b.pk, port=29556, backend="gloo")
    # not node 0: ignored
    gang.gang_master_set(addr="127.0.0.1", member_id=a.pk, port=29557, backend="gloo")
    assert gang.gang_start(member_id=a.pk) == "started"  # claimed for both, by either
    assert gang.gang_start(member_id=b.pk) == "started"
    assert not gang.gang_release(member_id=b.pk)  # started: no leaving now
    step.refresh_from_db()
    assert (step.status, step.attempts, step.worker) == (
        StepStatus.TRAINING, 1, "celery:training-b@h:22")
    rows = list(GangMember.objects.filter(step=step, attempt=1).order_by("node_rank")
                .values_list("worker", "master_addr", "master_port"))
    assert rows == [("celery:training-b@h:22", "127.0.0.1", 29556),
                    ("celery:training-a@h:11", "", None)]
    # The step is held now: a late member of this try joins nothing.
    assert gang.gang_join(step_id=step.pk, worker="celery:training-c@h:33") is None
    page = admin_client.get(f"/admin/trainer/trainingstep/{step.pk}/change/").content.decode()
    assert "celery:training-a@h:11" in page and "29556" in page  # the rows, in the admin


def checkpoint_state(algorithm, job, version: int) -> dict:
    resource = store_selectors.resources_get(project=job.project,
                                             resources_id=job.resources_id, version=version)
    return algorithm.load(find_checkpoint(resource.resources))


def finished_step(job, n: int = 0):
    def done() -> bool:
        services.steps_sweep()
        job.refresh_from_db()
        return (job.status != JobStatus.RUNNING
                or job.steps.filter(n=n, status=StepStatus.DONE).exists())
    return done


@pytest.fixture
def checkpoint_dir(settings, tmp_path) -> dict:
    path = tmp_path / "checkpoints"
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(path)}}}
    return {"CHECKPOINT_DIR": str(path)}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_gang_waits_for_its_missing_node_then_2_workers_x_2_ranks_match_world_size_1(
        rabbitmq_url, celery_workers, checkpoint_dir):
    celery_workers(queues=["rollouts"], broker_url=rabbitmq_url, concurrency=2,
                   env=checkpoint_dir)
    first = celery_workers(queues=["training"], broker_url=rabbitmq_url, concurrency=1,
                           env=checkpoint_dir, name="training-a")
    with use_broker(rabbitmq_url):
        # One fixed global batch of 35 samples (shards of 8, 9, 9, 9 over the 4 ranks): the
        # figure is the gang's; on a step's real samples Adam's first step can turn float
        # noise in near-zero gradients into +-lr at any world size > 1 (README).
        job = gang_job("gang-parity", gang_wait_seconds=3,
                       algorithm="tests.trainer_algorithms.FixedBatchGRPO")
        services.job_start(job_id=job.pk)
        step = job.steps.get(n=0)
        seen = []

        def reason_shown() -> bool:
            services.steps_sweep()
            seen.extend(reason for _, reason in selectors.waiting_steps(job_id=job.pk))
            return any("1 joined" in r for r in seen) and "did not form" in first.log()

        wait_until(reason_shown, timeout=300, message=lambda: f"no gang waiting reason: {seen[-3:]}")
        print(f"\nwaiting: {next(r for r in seen if '1 joined' in r)}")
        step.refresh_from_db()
        assert step.status == StepStatus.READY and step.attempts == 0  # nothing started
        assert step.device == ""
        wait_until(lambda: not GangMember.objects.filter(step=step).exists(), timeout=30,
                   message="the lone member kept its place")

        celery_workers(queues=["training"], broker_url=rabbitmq_url, concurrency=1,
                       env=checkpoint_dir, name="training-b")
        wait_until(finished_step(job), timeout=600, message="the gang step did not finish")
    step.refresh_from_db()
    assert job.status == JobStatus.RUNNING or job.status == JobStatus.SUCCEEDED, job.error
    assert step.device == "cpu x4 (2 nodes)"
    members = list(GangMember.objects.filter(step=step, attempt=step.attempts)
                   .order_by("node_rank"))
    assert [m.node_rank for m in members] == [0, 1]
    assert {m.worker.split(":")[1].split("@")[0] for m in members} == {"training-a",
                                                                       "training-b"}
    assert members[0].master_addr == "127.0.0.1" and members[0].master_port
    assert step.worker == members[0].worker
    # Each node's usage is in the ledger: node 0's with the finish, node 1's from its worker.
    wait_until(lambda: UsageEntry.objects.filter(group_id=step.group_id, kind="step")
               .count() == 2, timeout=60, message="a gang node's ledger row is missing")
    rows = UsageEntry.objects.filter(group_id=step.group_id, kind="step")
    assert all(r.cpu_seconds > 0 and r.gpu_seconds == 0 for r in rows)

    algorithm = algorithm_load(job.algorithm, {**services.job_config(job), "world_size": 1})
    state = checkpoint_state(algorithm, job, step.resources_version)
    samples = algorithm.samples(selectors.step_finished_rollouts(step=step))
    one = algorithm.update(step=0, state=state, samples=samples, device="cpu")
    gang_state = checkpoint_state(algorithm, job, step.produced_version)
    difference = max_weight_difference(one.state["model"], gang_state["model"])
    assert len(samples) == 35
    print(f"gang 2 nodes x 2 ranks vs world_size 1, cipher MLP, {len(samples)} samples: "
          f"max abs weight difference {difference:.3g}")
    assert difference < 1e-5
    assert max_weight_difference(one.state["model"], state["model"]) > 1e-3  # it did train


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("victim_node", [1, 0])  # node 0 also serves the TCPStore
def test_kill_9_of_one_gang_member_fails_the_try_on_every_member_and_the_step_is_redone(
        rabbitmq_url, celery_workers, checkpoint_dir, tmp_path, victim_node):
    pid_dir, marker = tmp_path / "pids", tmp_path / "hold-no-more"
    pid_dir.mkdir()
    celery_workers(queues=["rollouts"], broker_url=rabbitmq_url, concurrency=2,
                   env=checkpoint_dir)
    trainers = [celery_workers(queues=["training"], broker_url=rabbitmq_url, concurrency=1,
                               env=checkpoint_dir, name=name)
                for name in ("training-a", "training-b")]
    with use_broker(rabbitmq_url):
        job = gang_job("gang-kill", algorithm="tests.trainer_algorithms.GangHoldGRPO",
                       pid_dir=str(pid_dir), hold_marker=str(marker),
                       gang_peer_timeout_seconds=20)
        services.job_start(job_id=job.pk)

        def all_ranks_in_the_step() -> bool:
            services.steps_sweep()
            return len(list(pid_dir.iterdir())) == 4

        wait_until(all_ranks_in_the_step, timeout=400, message="the gang's ranks never met")
        first_try = {int((pid_dir / f"rank{r}").read_text()) for r in range(4)}
        marker.write_text("")
        victim = GangMember.objects.get(step__job=job, attempt=1, node_rank=victim_node)
        os.kill(victim.pid, signal.SIGKILL)  # the member's pool process, mid-step
        wait_until(finished_step(job), timeout=600, message="the step was not redone")
    step = job.steps.get(n=0)
    assert step.status == StepStatus.DONE, (job.error, step.error)
    assert step.attempts == 2  # the killed try, then the one that trained
    # The survivor saw its peer's process gone, stopped its ranks and failed the try.
    survivor = next(w for w in trainers if w.name != victim.worker.split(":")[1].split("@")[0])
    assert f"gang node {victim_node} ({victim.worker}) died" in survivor.log()
    wait_until(lambda: not [p for p in first_try if psutil.pid_exists(p)
                            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE],
               timeout=60, message="a rank of the killed try outlived it")
    versions = [v.version for v in selectors.job_checkpoints(job=job)]
    print(f"\nversions {sorted(versions)}")
    assert sorted(versions) == list(range(1, len(versions) + 1)) == [1, 2]
    assert step.produced_version == 2
    assert GangMember.objects.filter(step=step, attempt=2).count() == 2


@pytest.mark.django_db
def test_a_member_that_died_while_gathering_loses_its_place_and_node_0_goes_to_the_next():
    job = gang_job("gang-silent", gang_peer_timeout_seconds=30)
    services.job_start(job_id=job.pk)
    step = job.steps.get(n=0)
    TrainingStep.objects.filter(pk=step.pk).update(status=StepStatus.READY)
    dead = gang.gang_join(step_id=step.pk, worker="celery:training-a@h:11")
    gang.gang_master_set(addr="127.0.0.1", member_id=dead.pk, port=29555, backend="gloo")
    alive = gang.gang_join(step_id=step.pk, worker="celery:training-b@h:22")
    assert (dead.node_rank, alive.node_rank) == (0, 1)
    # node 0 was killed while it waited: it polls no more
    GangMember.objects.filter(pk=dead.pk).update(seen_at=timezone.now() - timedelta(seconds=31))
    assert gang.gang_start(member_id=alive.pk) == "waiting"  # not started with a dead member
    assert not GangMember.objects.filter(pk=dead.pk).exists()
    after = gang.gang_join(step_id=step.pk, worker="celery:training-c@h:33")
    assert after.node_rank == 0
    gang.gang_master_set(addr="127.0.0.1", member_id=after.pk, port=29556, backend="gloo")
    assert gang.gang_start(member_id=alive.pk) == "started"
    step.refresh_from_db()
    assert (step.attempts, step.worker) == (1, "celery:training-c@h:33")


@pytest.mark.django_db
def test_train_refuses_nodes_on_the_embedded_default_which_runs_one_training_worker(settings):
    settings.EMBEDDED_WORKERS = True
    with pytest.raises(CommandError, match="nodes > 1 needs as many training workers"):
        call_command("train", "examples.cipher", "--world-size", "4", "--nodes", "2")
    assert not TrainingJob.objects.exists()


@pytest.mark.django_db
def test_a_member_checks_its_peers_dead_on_its_host_silent_elsewhere_and_its_try():
    job = gang_job("gang-watch", gang_peer_timeout_seconds=30)
    services.job_start(job_id=job.pk)
    step = job.steps.get(n=0)
    TrainingStep.objects.filter(pk=step.pk).update(status=StepStatus.READY)
    a = gang.gang_join(step_id=step.pk, worker="celery:training-a@h:11")
    b = gang.gang_join(step_id=step.pk, worker="celery:training-b@h:22")
    gang.gang_master_set(addr="127.0.0.1", member_id=a.pk, port=29555, backend="gloo")
    assert gang.gang_start(member_id=b.pk) == "started"
    b.refresh_from_db()
    check = gang._watch(a, [b], silent_seconds=30)
    assert check() is None  # b is this test process: alive, and just seen
    TrainingStep.objects.filter(pk=step.pk).update(status=StepStatus.DONE)
    assert check() is None  # node 0 finished the try while this node's ranks were leaving
    TrainingStep.objects.filter(pk=step.pk).update(status=StepStatus.TRAINING)
    GangMember.objects.filter(pk=b.pk).update(
        host="elsewhere", seen_at=timezone.now() - timedelta(seconds=31))
    b.refresh_from_db()
    assert gang._watch(a, [b], silent_seconds=30)() == (
        "gang node 1 (celery:training-b@h:22) silent for more than 30s")
    gone = psutil.Popen(["true"])
    gone.wait()
    GangMember.objects.filter(pk=b.pk).update(host=socket.gethostname(), pid=gone.pid)
    b.refresh_from_db()
    assert gang._watch(a, [b], silent_seconds=3600)() == (
        "gang node 1 (celery:training-b@h:22) died")
    check = gang._watch(a, [], silent_seconds=30)
    services.step_record_failure(step_id=step.pk, attempt=1, error="elsewhere")
    assert check() == "try 1 of the step ended on another node"


@pytest.mark.django_db
def test_a_members_usage_is_recorded_only_while_its_try_is_the_steps():
    job = gang_job("gang-usage")
    services.job_start(job_id=job.pk)
    step = job.steps.select_related("job").get(n=0)
    TrainingStep.objects.filter(pk=step.pk).update(status=StepStatus.TRAINING, attempts=1)
    usage = store_services.Usage(cpu_seconds=2.5, gpu_seconds=8.0, gpu_type="NVIDIA H100")
    assert services.step_record_member_usage(step=step, attempt=1, usage=usage)
    TrainingStep.objects.filter(pk=step.pk).update(status=StepStatus.DONE)
    assert services.step_record_member_usage(step=step, attempt=1, usage=usage)  # node 0 won
    assert not services.step_record_member_usage(step=step, attempt=2, usage=usage)
    TrainingStep.objects.filter(pk=step.pk).update(status=StepStatus.READY)  # the try failed
    assert not services.step_record_member_usage(step=step, attempt=1, usage=usage)
    rows = list(UsageEntry.objects.filter(group_id=step.group_id, kind="step")
                .values_list("cpu_seconds", "gpu_seconds", "gpu_type"))
    assert rows == [(2.5, 8.0, "NVIDIA H100")] * 2


@pytest.mark.django_db
def test_a_gang_whose_rollouts_failed_runs_them_again_before_any_rank_starts():
    job = gang_job("gang-precheck")
    services.job_start(job_id=job.pk)
    step = job.steps.get(n=0)
    TrainingStep.objects.filter(pk=step.pk).update(status=StepStatus.READY)
    a = gang.gang_join(step_id=step.pk, worker="celery:training-a@h:11")
    b = gang.gang_join(step_id=step.pk, worker="celery:training-b@h:22")
    gang.gang_master_set(addr="127.0.0.1", member_id=a.pk, port=29555, backend="gloo")
    assert gang.gang_start(member_id=b.pk) == "started"
    Rollout.objects.filter(group_id=step.group_id).update(status=RolloutStatus.FAILED)
    step = TrainingStep.objects.select_related("job").get(pk=step.pk)
    # Both members look; the first records the failed try (its rollouts run again), the
    # other finds the try gone; neither starts a rank (no TCPStore serves port 29555).
    assert gang._run(b, step, CpuMeter(), DB_RETRY) == "retry"
    assert gang._run(a, step, CpuMeter(), DB_RETRY) == "lost"
    step.refresh_from_db()
    assert (step.status, step.round, step.attempts) == (StepStatus.ROLLING, 1, 1)
    assert "train rollouts failed" in step.error
