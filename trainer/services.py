"""Every write of the trainer: keyword-only, typed, one short transaction each, status changes
by compare-and-swap. Files and torch work happen outside transactions.

The loop (DESIGN.md "The training loop as data"): `job_start` writes checkpoint 0 and plans
step 0; its rollouts finish (the store counts them in the step's rollout group and writes a
completion, which trainer.reactions takes -> `step_check_ready`); the train-step task runs
`step_train`: claim, learn, then `step_finish` writes checkpoint k+1 and plans step n+1 in one
transaction. The final step (n == steps) only evaluates. `steps_sweep` re-sends what a dead
process left behind.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from core import control, devices
from core.processes import process_alive
from core.publish import target_problem
from core.retry import DEFAULT as DB_RETRY
from core.retry import RetryPolicy
from core.usage import CpuMeter, cuda_held
from store import selectors as store_selectors
from store import services as store_services
from store.errors import IllegalTransition, InvalidInput
from store.models import Project
from store.services import RolloutSpec
from store.statemachine import ROLLOUT_TERMINAL, RolloutConfig, RolloutStatus
from trainer import checkpoints, delivery, distributed, pool, selectors, staleness
from trainer.algorithms import Algorithm, algorithm_class, algorithm_load
from trainer.algorithms.base import BASE_CONFIG_KEYS
from trainer.config_keys import JOB_RULES, unknown_key_error, value_error
from trainer.lease import lease_kept
from trainer.models import (
    GROUP_OWNER,
    STEP_OPEN,
    JobStatus,
    StepStatus,
    TrainingJob,
    TrainingStep,
    group_key,
)
from trainer.statemachine import step_move

# Defaults of a job's config; the config given to job_create overrides them.
JOB_DEFAULTS: dict[str, Any] = {
    "steps": 10,
    "seed": 0,
    # local processes of one train step (DDP; trainer/distributed.py); 1: in the worker itself
    "world_size": 1,
    # how those processes share the model: "ddp" (a copy each, gradients all-reduced) or
    # "fsdp" (FSDP2: parameters sharded, checkpoints through torch.distributed.checkpoint)
    "parallel": "ddp",
    # training workers (nodes) that run one step together as a gang (trainer/gang.py), each
    # with world_size / nodes local ranks; 1: one worker runs the step
    "nodes": 1,
    # a gathered gang member waits this long for the others, then gives its place back
    "gang_wait_seconds": 60,
    # a gang member silent this long (no heartbeat row update) fails the try on the others
    "gang_peer_timeout_seconds": 30,
    # tries of one train step (a worker killed mid-step counts) before the job fails
    "max_step_attempts": 3,
    # a step whose share of failed train rollouts, or of failed validation rollouts, is above
    # this is a failed try: its rollouts run again (a new round) while tries are left, then
    # the job fails with the first rollout's error, instead of "succeeding" on nothing
    "max_failed_rollout_share": 0.5,
    # a claimed step is its worker's until then; longer than the slowest train step
    "step_lease_seconds": 120,
    # past this, a step trains on what finished and cancels the rest
    "step_timeout_seconds": 600,
    # a ready step whose task did not start by then is sent again
    "resend_seconds": 30,
    "keep_last": 10,
    # asynchronous training (trainer/staleness.py): a sample is trained on only by a step
    # that starts from a version at most this many versions newer than the one that produced
    # it; 0: the synchronous loop. `steps_ahead` (default: max_staleness) is the pacing: how
    # many later steps' rollouts may run while a step trains.
    "max_staleness": 0,
    # consuming groups (`consume`, trainer/pool.py): groups planned beyond what the steps
    # train on, so no step waits for the slowest; None: half the groups step 0 trains on
    # (README "Asynchronous training", spare groups)
    "spare_groups": None,
    # the store's RolloutConfig of the job's rollouts: a killed runner's rollout is retried
    "rollout_config": {"timeout_seconds": 300, "unresponsive_seconds": 60, "max_attempts": 3,
                       "retry_condition": ["timeout", "unresponsive"]},
}

# Job config keys the trainer reads that have no default: asynchronous pacing (README
# "Asynchronous training"), routing by need ("Routing a step by what it needs") and the reward
# a job's summary compares with (`threshold`).
JOB_OPTIONAL_KEYS: frozenset[str] = frozenset(
    {"steps_ahead", "consume", "partial_rollouts", "resources", "threshold"})

log = logging.getLogger(__name__)


class JobError(Exception):
    pass


class NoSamples(Exception):
    """A step's succeeded train rollouts gave nothing to train on (the message says why): a
    failed try, recorded as its message alone, not a traceback."""


def _now() -> datetime:
    return timezone.now()


def _iso(moment: datetime) -> str:
    return moment.isoformat()


def job_config(job: TrainingJob) -> dict[str, Any]:
    return {**JOB_DEFAULTS, **job.config}


def job_create(
    *, project: Project, agent: str, algorithm: str, config: dict[str, Any],
    train_dataset: list[Any], val_dataset: list[Any] | None = None, name: str = "",
) -> TrainingJob:
    """A pending job; `job_start` starts it. The algorithm is built once to check the config."""
    merged = {**JOB_DEFAULTS, **config}
    if (problem := value_error(merged, JOB_RULES)) is not None:
        raise InvalidInput(*problem)
    RolloutConfig.parse(merged["rollout_config"])
    if not isinstance(agent, str) or "." not in agent:
        raise InvalidInput("agent", "must be a dotted path, e.g. 'myagents.math:agent'")
    if (problem := target_problem(delivery.ROLLOUT_TASK, agent)) is not None:
        raise InvalidInput("agent", problem)
    for field_name, dataset in (("train_dataset", train_dataset), ("val_dataset", val_dataset)):
        if dataset is not None and not isinstance(dataset, list | tuple):
            raise InvalidInput(field_name, f"must be a list of tasks, got "
                               f"{type(dataset).__name__}")
    try:
        cls = algorithm_class(algorithm)
    except (ImportError, ValueError) as exc:
        raise InvalidInput("algorithm", str(exc)) from None
    declared = None if cls.config_keys is None else cls.config_keys | BASE_CONFIG_KEYS
    if (problem := unknown_key_error(config, job_keys=set(JOB_DEFAULTS) | JOB_OPTIONAL_KEYS,
                                     algorithm=algorithm, declared=declared)) is not None:
        raise InvalidInput(*problem)
    if (problem := value_error(config, cls.config_rules)) is not None:
        raise InvalidInput(*problem)
    try:
        built = cls(merged)
    except InvalidInput:
        raise
    except (ImportError, ValueError, KeyError) as exc:
        raise InvalidInput("algorithm", str(exc)) from None
    if (why := distributed.world_size_error(merged, built)) is not None:
        raise InvalidInput("config.world_size", why)
    if (problem := staleness.config_error(merged)) is not None:
        raise InvalidInput(*problem)
    if (why := distributed.parallel_error(merged, built)) is not None:
        raise InvalidInput("config.parallel", why)
    if (why := distributed.nodes_error(merged)) is not None:
        raise InvalidInput("config.nodes", why)
    try:
        need = devices.resources_parse(merged.get("resources"))
    except devices.ResourcesError as exc:
        raise InvalidInput(f"config.{exc.field}", exc.message) from None
    local_ranks = distributed.world_size_of(merged) // distributed.nodes_of(merged)
    if need.gpus and local_ranks > need.gpus:
        raise InvalidInput("config.resources.gpus",
                           f"each of the {local_ranks} ranks of a node takes one GPU; gpus "
                           f"(per node) must be >= world_size / nodes, got {need.gpus}")
    return TrainingJob.objects.create(
        project=project, name=name, agent=agent, algorithm=algorithm, config=merged,
        train_dataset=list(train_dataset), val_dataset=list(val_dataset or []),
    )


def job_start(*, job_id: int) -> TrainingJob:
    """pending -> running: write checkpoint 0 as resources version 1 and plan step 0.
    Starting a job that already started does nothing."""
    job = TrainingJob.objects.get(pk=job_id)
    if job.status != JobStatus.PENDING:
        return job
    try:
        algorithm = algorithm_load(job.algorithm, job_config(job))
        # The file is written before the transaction (no file work inside one); a start that
        # loses the race below leaves a content-addressed file the winner also wrote.
        resource = algorithm.save(algorithm.init_state(), name_prefix=f"jobs/{job.pk}", step=0)
        published = algorithm.published_resources(resource, job_id=job.pk)
    except Exception as exc:
        # A job that cannot write its checkpoint 0 fails now: left pending, nothing would
        # ever start it (a policy factory that raises, a model directory that is not one).
        error = f"job {job.pk} could not start: {exc!r}"
        TrainingJob.objects.filter(pk=job.pk, status=JobStatus.PENDING).update(
            status=JobStatus.FAILED, error=error, finished_at=_now())
        raise JobError(error) from exc
    now = _now()
    with transaction.atomic():
        if not TrainingJob.objects.filter(pk=job.pk, status=JobStatus.PENDING).update(
            status=JobStatus.RUNNING, started_at=now
        ):
            return TrainingJob.objects.get(pk=job.pk)
        job.refresh_from_db()
        version = store_services.resources_add(
            project=job.project, resources={"checkpoint": resource, **published}
        )
        job.resources_id = version.resource_set.resources_id
        TrainingJob.objects.filter(pk=job.pk).update(resources_id=job.resources_id)
        for n in staleness.steps_in_flight(job_config(job), done=None,
                                           total=job_config(job)["steps"]):
            _step_plan(job, algorithm, n=n, resources_version=version.version)
    return job


def _step_plan(job: TrainingJob, algorithm: Algorithm, *, n: int, resources_version: int,
               round: int = 0, attempts: int = 0, error: str = "") -> TrainingStep:
    """Create step n (inside the caller's transaction) with a new rollout group for this
    round, enqueue its rollouts into that group, and send them (and the train task, for an
    empty plan) after commit. Planning a round whose group exists creates nothing new."""
    config = job_config(job)
    planned = algorithm.plan(step=n, final=n >= config["steps"],
                             train_dataset=job.train_dataset, val_dataset=job.val_dataset)
    planned.sort(key=lambda p: p.mode != "train")  # train first, then val: keys follow order
    # step 0 plans the job's spare groups too (every round of it: they stay in the pool)
    spares = pool.spare_plan(algorithm, job, config, planned) if n == 0 else []
    now = _now()
    fields = {
        "round": round, "resources_version": resources_version,
        "rollout_count": sum(1 for p in planned if p.mode == "train") + len(spares),
        "val_rollout_count": sum(1 for p in planned if p.mode != "train"),
        "deadline": now + timedelta(seconds=config["step_timeout_seconds"]),
        "attempts": attempts, "lease_until": None, "error": error, "produced_version": None,
        "timings": {"planned": _iso(now)}, "metrics": {},
    }
    step = TrainingStep.objects.filter(job=job, n=n).first()
    if step is None:
        step = TrainingStep.objects.create(job=job, n=n, status=StepStatus.ROLLING, **fields)
    else:  # planned again: a new round (the caller holds the job's row)
        if not step_move(step.pk, expect=[step.status], to=StepStatus.ROLLING, now=now,
                         **fields):
            raise JobError(f"step {n} of job {job.pk} changed while planning; try again")
        step.refresh_from_db()
    group, created = store_services.group_create(
        project=job.project, key=group_key(step.pk, round), owner=GROUP_OWNER)
    TrainingStep.objects.filter(pk=step.pk).update(group=group)
    step.group = group
    if not created:
        return step
    train = [p for p in planned if p.mode == "train"]
    specs = [
        RolloutSpec(
            input=p.input, mode=p.mode, resources_id=job.resources_id,
            config=config["rollout_config"],
            metadata=pool.rollout_metadata(job, config, n, spare=spare),
        )
        for part, spare in ((train, False), (spares, True), (planned[len(train):], False))
        for p in part
    ]
    pool.rollouts_send(job, group, specs)
    if not specs:
        step_check_ready(step_id=step.pk)
    return step


def step_check_ready(*, step_id: int, now: datetime | None = None) -> bool:
    """rolling -> ready when the step's rollout group finished (the store's counters), or
    when its deadline passed (the rest are cancelled). Sends the train task after commit.
    True if it moved."""
    now = now or _now()
    step = TrainingStep.objects.select_related("job", "group").filter(pk=step_id).first()
    if step is None:  # its job was deleted
        return False
    if step.status != StepStatus.ROLLING or step.job.status != JobStatus.RUNNING:
        return False
    if not _turn_come(step):  # an asynchronous job's step planned ahead waits for its turn
        return False
    finished = step.group is None or step.group.finished >= step.group.total
    overdue = step.deadline is not None and step.deadline <= now
    if _consumes_groups(step):
        # its own groups may be taken by an earlier step: enough complete groups decide
        # (trainer/pool.py); its open rollouts stay for later steps unless overdue
        finished = not overdue and pool.ready(step, job_config(step.job),
                                              base=_base_version(step))
    if not finished and not overdue:
        return False
    open_ids = [] if finished else selectors.step_open_rollout_ids(step=step)
    timings = {**step.timings, "ready": _iso(now)}
    with transaction.atomic():
        # The step as read, not only its status: a cancel and resume between the read and
        # here plans a new round with a new group, which this check has not looked at.
        moved = step_move(step.pk, expect=[StepStatus.ROLLING], to=StepStatus.READY, now=now,
                          where=Q(round=step.round, group_id=step.group_id,
                                  job__status=JobStatus.RUNNING),
                          sent_at=now, timings=timings)
        if moved:
            transaction.on_commit(lambda: delivery.send_train_step(step.pk), robust=True)
    if moved and open_ids:
        _cancel_rollouts(step.job.project, open_ids)
    return bool(moved)


def _turn_come(step: TrainingStep) -> bool:
    """Step n trains from the version step n-1 produced: in an asynchronous job it may
    become ready only once step n-1 is done (a synchronous job plans it only then)."""
    if staleness.bound(job_config(step.job)) == 0 or step.n == 0:
        return True
    return TrainingStep.objects.filter(job_id=step.job_id, n=step.n - 1,
                                       status=StepStatus.DONE).exists()


def _base_version(step: TrainingStep) -> int:
    """The version step n trains from: the one step n-1 produced, which is also the one its
    rollouts pinned in a synchronous job (there, always `resources_version`)."""
    if staleness.bound(job_config(step.job)) == 0 or step.n == 0:
        return step.resources_version
    previous = TrainingStep.objects.filter(job_id=step.job_id, n=step.n - 1).values_list(
        "produced_version", flat=True).first()
    return previous or step.resources_version


def _cancel_rollouts(project: Project, rollout_ids: list[str]) -> None:
    for rollout_id in rollout_ids:
        try:
            store_services.rollout_update(project=project, rollout_id=rollout_id,
                                          status=RolloutStatus.CANCELLED)
        except IllegalTransition:
            pass  # it finished in the meantime: terminal rollouts stay terminal


def step_claim(*, step_id: int, worker: str, now: datetime | None = None,
               worker_devices: list[dict[str, Any]] | None = None) -> TrainingStep | None:
    """ready (or training with an expired lease: its worker died) -> training, counting the
    try. None when the step is not claimable: done, held by a live worker, or its job is not
    running (a redelivered message then does nothing), or when the job's `resources` need
    more than this worker's devices (`worker_devices`, default this process's: the claim
    filter of core/devices.py; the step stays for a worker that has them). A step
    tried too often fails its job."""
    now = now or _now()
    step = TrainingStep.objects.select_related("job").filter(pk=step_id).first()
    if step is None:  # its job was deleted since the message was sent: nothing to do
        return None
    need = devices.resources_parse(step.job.config.get("resources"))
    if need.any:
        have = devices.local_devices() if worker_devices is None else worker_devices
        if not devices.fits(have, need):
            log.info("step %s needs %s; %s has %s: left for another worker", step.pk,
                     need.describe(), worker, devices.describe_devices(have))
            return None
    claimable = Q(status=StepStatus.READY) | Q(status=StepStatus.TRAINING, lease_until__lt=now)
    if holder_dead(step, worker):
        # The redelivered message of a killed training worker: no need to wait for the lease.
        claimable |= Q(status=StepStatus.TRAINING, worker=step.worker)
    config = job_config(step.job)
    if step.attempts >= config["max_step_attempts"]:
        if TrainingStep.objects.filter(claimable, pk=step.pk).exists():
            _step_give_up(step, step.error or "the training worker was lost on every try")
        return None
    timings = {**step.timings, "train_started": _iso(now)}
    moved = step_move(
        step.pk, expect=[StepStatus.READY, StepStatus.TRAINING], to=StepStatus.TRAINING,
        where=claimable & Q(attempts=step.attempts, job__status=JobStatus.RUNNING), now=now,
        attempts=step.attempts + 1, worker=worker,
        lease_until=now + timedelta(seconds=config["step_lease_seconds"]), timings=timings,
    )
    if not moved:
        return None
    step.refresh_from_db()
    return step


def holder_dead(step: TrainingStep, worker: str) -> bool:
    """The step is held by a process of this worker node ("celery:<node>:<pid>") that is gone."""
    node, _, pid = step.worker.rpartition(":")
    here, _, mine = worker.rpartition(":")
    return (step.status == StepStatus.TRAINING and bool(node) and node == here
            and pid.isdigit() and pid != mine and not process_alive(int(pid)))


@dataclass
class TrainResult:
    checkpoint: dict[str, Any] | None
    metrics: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    seconds: float = 0.0
    published: dict[str, Any] = field(default_factory=dict)  # beside the checkpoint
    # CUDA devices the update ran on (its ranks' when distributed; 0 on the CPU)
    devices: int = 0
    # the rollouts trained on, when the job consumes groups (stored as the step's `trained`)
    trained: list[str] | None = None


def train_device() -> str:
    """CUDA when this worker has it, else the CPU; recorded on the step."""
    import torch  # here, not at the top: processes that never train never load torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def step_train(*, step_id: int, worker: str | None = None,
               retry: RetryPolicy = DB_RETRY) -> str:
    """The train-step task's body: claim, learn, write the next checkpoint, plan the next step.
    Returns what happened: done, skipped (nothing to do), quota (step_quota_wait), retry,
    failed or lost.

    Once the step is claimed, this try holds it until its lease ends (a live process's hold
    is not taken over), so every database call after the claim retries transient errors
    (`retry`, core/retry.py: about 30 s of backoff): Postgres restarting while a
    step trained must cost a few seconds, not the lease. A transient error in the claim
    itself fails the task, which Celery retries (trainer/tasks.py): nothing is held then."""
    worker = worker or f"{socket.gethostname()}:{os.getpid()}"
    meter = CpuMeter()  # the task's CPU, for the step's ledger row (README "Cost")
    if (held := step_quota_wait(step_id)) is not None:
        return held
    step = step_claim(step_id=step_id, worker=worker)
    if step is None:
        return "skipped"
    outcome, picked = step_precheck(step, retry)
    if outcome is not None:
        return outcome
    try:
        with lease_kept(step, job_config(step.job)["step_lease_seconds"]):
            result = train_run(step, picked=picked)
    except Exception as exc:
        error = str(exc) if isinstance(exc, NoSamples) else traceback.format_exc(limit=8)
        return retry.call(lambda: step_record_failure(
            step_id=step.pk, attempt=step.attempts, error=error),
            what=f"step {step.pk}: recording a failure")
    usage = step_usage(meter, result)
    return retry.call(lambda: step_finish(step, result, usage),
                      what=f"step {step.pk}: finishing")


def step_quota_wait(step_id: int) -> str | None:
    """"quota" when the step's project reached its GPU quota (README "Quotas"), else None.
    Looked at before the claim, by one worker and by each gang member before it joins: the
    step stays ready with no try counted and no lease or gang place taken, shown waiting with
    the reason (selectors.step_waiting_reason), and the trainer sweep sends it again every
    `resend_seconds` (as a gang that did not form) until usage ages out of the window. No
    rollouts are planned meanwhile: the next step's are planned when this one finishes."""
    reason = selectors.step_quota_reason(step_id=step_id)
    if reason is None:
        return None
    log.info("step %s waits: %s", step_id, reason)
    return "quota"


def step_precheck(step: TrainingStep, retry: RetryPolicy = DB_RETRY
                  ) -> tuple[str | None, pool.Picked | None]:
    """Before a claimed step trains: an asynchronous job consuming groups picks them (the
    second item); a group that aged past the bound is planned again ("replanned"), rollouts
    that failed beyond the share are a failed try that runs them again ("retry"/"failed");
    a first item None: train. Each is a compare-and-swap on the try, so the members of a gang
    may all call it and one acts."""
    picked = None
    if _consumes_groups(step):
        picked = retry.call(lambda: pool.pick(step, job_config(step.job),
                                              base=_base_version(step)),
                            what=f"step {step.pk}: picking groups")
        stale = 0 if picked.units else picked.own_past
    elif staleness.bound(job_config(step.job)) > 0:
        stale = retry.call(lambda: _stale_count(step), what=f"step {step.pk}: staleness")
    else:
        stale = 0
    if stale:
        return retry.call(lambda: _step_replan_stale(step, stale),
                          what=f"step {step.pk}: planning a stale group again"), None
    failure = retry.call(lambda: _rollouts_failure(step), what=f"step {step.pk}: rollouts")
    if failure is not None:
        return retry.call(lambda: step_record_failure(
            step_id=step.pk, attempt=step.attempts, error=failure, rerun_rollouts=True),
            what=f"step {step.pk}: recording a failure"), None
    return None, picked


def step_usage(meter: CpuMeter, result: TrainResult) -> store_services.Usage:
    """CPU time of this process and its waited-for ranks; GPU-seconds: the training's wall
    time x the CUDA devices it ran on."""
    name = cuda_held()[1] if result.devices else ""
    return store_services.Usage(cpu_seconds=meter.cpu_seconds(),
                                gpu_seconds=result.seconds * result.devices, gpu_type=name)


def step_record_member_usage(*, step: TrainingStep, attempt: int,
                             usage: store_services.Usage) -> bool:
    """A gang member's own ledger row (a node other than 0, README "Cost"): what its ranks
    used, written when its part of try `attempt` ends, while the step's try is that one
    (training, or done by node 0 already); node 0's row is written with the step's finish.
    False when the try is gone (failed or taken over: its usage is not billed, as a single
    worker's failed try)."""
    with transaction.atomic():
        ours = (TrainingStep.objects.select_for_update().filter(
            pk=step.pk, attempts=attempt, status__in=[StepStatus.TRAINING, StepStatus.DONE])
            .exists())
        if ours:
            store_services.usage_record_step(project=step.job.project, group_id=step.group_id,
                                             usage=usage)
    return ours


def _consumes_groups(step: TrainingStep) -> bool:
    """An asynchronous job consuming groups, at a step that trains (not the final one)."""
    config = job_config(step.job)
    return staleness.consumes_groups(config) and step.n < config["steps"]


def _stale_count(step: TrainingStep) -> int:
    """How many of the step's finished train rollouts were produced (in part) by a version
    older than the bound allows for the version the step trains from."""
    versions = [r.version for r in selectors.step_finished_rollouts(step=step)
                if r.mode == "train" and r.succeeded]
    return staleness.too_stale(versions, base=_base_version(step),
                               limit=staleness.bound(job_config(step.job)))


def _step_replan_stale(step: TrainingStep, stale: int) -> str:
    """training -> rolling: the step's group aged past the bound, so its rollouts are planned
    again against the current version (a new round; never dropped silently: counted on the
    step and in its metrics). The try is given back: it was no failure."""
    job = step.job
    with transaction.atomic():
        if not step_move(step.pk, expect=[StepStatus.TRAINING], to=None,
                         where=Q(attempts=step.attempts)):
            return "lost"
        algorithm = algorithm_load(job.algorithm, job_config(job))
        _step_plan(job, algorithm, n=step.n, resources_version=_base_version(step),
                   round=step.round + 1, attempts=step.attempts - 1)
        TrainingStep.objects.filter(pk=step.pk).update(
            stale_replans=F("stale_replans") + 1,
            stale_rollouts=F("stale_rollouts") + step.rollout_count)
    return "replanned"


def _rollouts_failure(step: TrainingStep) -> str | None:
    """Why the step's rollouts are no basis for a step: more than the job's
    `max_failed_rollout_share` of its train rollouts, or of its validation rollouts (an
    evaluation-only job has nothing else), failed (a broken agent, an unreadable
    checkpoint). None when they are."""
    share = job_config(step.job)["max_failed_rollout_share"]
    rollouts = selectors.step_rollouts(step=step)
    for kind, of_kind, total in (
        ("train", rollouts.filter(mode="train"), step.rollout_count),
        ("validation", rollouts.exclude(mode="train"), step.val_rollout_count),
    ):
        failed = list(of_kind.filter(status=RolloutStatus.FAILED).values_list("pk", flat=True))
        if total and len(failed) > share * total:
            first = store_selectors.rollouts_first_error(rollout_ids=failed)
            return (f"{len(failed)} of {total} {kind} rollouts failed (more than "
                    f"max_failed_rollout_share={share}); the first: {first}")
    return None


# A gang member's way of running the update (trainer/gang.py): (Update, device label, CUDA
# devices), the Update None on a node other than 0 (node 0 saves and finishes the step).
UpdateRunner = Callable[[Algorithm, int, dict[str, Any], list[Any]], tuple[Any, str, int]]


def train_run(step: TrainingStep, run_update: UpdateRunner | None = None,
              picked: pool.Picked | None = None) -> TrainResult:
    started = time.perf_counter()
    job = step.job
    config = job_config(job)
    algorithm = algorithm_load(job.algorithm, config)
    rollouts = selectors.step_finished_rollouts(step=step)
    if picked is not None:  # the groups picked, wherever planned, and its own validation
        rollouts = picked.rollouts + [r for r in rollouts if r.mode != "train"]
    metrics = algorithm.report(rollouts)
    device = train_device()
    resource, published, devices = None, {}, 0
    if staleness.bound(config) > 0:
        base = _base_version(step)
        metrics.update(staleness.staleness_metrics(
            [r.version for r in rollouts if r.mode == "train" and r.succeeded], base=base))
        metrics.update(samples_replanned=step.stale_rollouts, stale_replans=step.stale_replans,
                       trained_from_version=base)
        if picked is not None:
            metrics.update(groups_trained=len(picked.units), groups_borrowed=sum(
                1 for u in picked.units if u.key[0] != step.group_id))
    if algorithm.trains and step.n < config["steps"]:
        version = store_selectors.resources_get(
            project=job.project, resources_id=job.resources_id, version=_base_version(step)
        )
        state = algorithm.load(checkpoints.find_checkpoint(version.resources))
        samples = algorithm.samples(rollouts)
        if not samples and (why := algorithm.no_samples(rollouts)) is not None:
            raise NoSamples(f"step {step.n}: {why}")
        world_size = distributed.world_size_of(config)
        if run_update is not None:
            update, device, devices = run_update(algorithm, step.n, state, samples)
            if update is None:
                return TrainResult(None, metrics, device, time.perf_counter() - started,
                                   devices=devices)
        elif world_size > 1:
            update, device = distributed.update(algorithm, step=step.n, state=state,
                                                samples=samples, world_size=world_size,
                                                parallel=distributed.parallel_of(config))
        else:
            update = algorithm.update(step=step.n, state=state, samples=samples,
                                      device=device)
        if run_update is None:
            devices = (world_size if world_size > 1 else 1) if device.startswith("cuda") else 0
        metrics.update(update.metrics)
        if update.state is not None:
            resource = algorithm.save(update.state, name_prefix=f"jobs/{job.pk}",
                                      step=step.n + 1, metrics=metrics)
            published = algorithm.published_resources(resource, job_id=job.pk)
    return TrainResult(resource, metrics, device, time.perf_counter() - started, published,
                       devices, None if picked is None else picked.rollout_ids)


def step_finish(step: TrainingStep, result: TrainResult,
                 usage: store_services.Usage | None = None) -> str:
    """training -> done in one transaction with the new resources version, the step's ledger
    row and step n+1's plan; a try that lost its lease to another one changes nothing
    ("lost")."""
    now = _now()
    timings = {**step.timings, "done": _iso(now), "train_seconds": round(result.seconds, 4)}
    with transaction.atomic():
        job = TrainingJob.objects.select_for_update().get(pk=step.job_id)
        if not step_move(step.pk, expect=[StepStatus.TRAINING], to=StepStatus.DONE,
                         where=Q(attempts=step.attempts), now=now, metrics=result.metrics,
                         device=result.device, timings=timings, lease_until=None, error="",
                         trained=result.trained or []):
            return "lost"
        store_services.usage_record_step(project=job.project, group_id=step.group_id,
                                         usage=usage or store_services.Usage(), now=now)
        produced = step.resources_version
        if result.checkpoint is not None:
            produced = store_services.resources_update(
                project=job.project, resources_id=job.resources_id,
                resources={"checkpoint": result.checkpoint, **result.published},
            ).version
        step_move(step.pk, expect=[StepStatus.DONE], to=None, now=now,
                  produced_version=produced)
        _track_best(job, step, result.metrics)
        if job.status == JobStatus.RUNNING:
            _advance(job, step, produced, now)
    transaction.on_commit(lambda: _retain(job), robust=True)
    return "done"


def _advance(job: TrainingJob, step: TrainingStep, produced: int, now: datetime) -> None:
    if step.n >= job_config(job)["steps"]:
        TrainingJob.objects.filter(pk=job.pk, status=JobStatus.RUNNING).update(
            status=JobStatus.SUCCEEDED, finished_at=now
        )
        return
    algorithm = algorithm_load(job.algorithm, job_config(job))
    config = job_config(job)
    if staleness.bound(config) == 0:
        _step_plan(job, algorithm, n=step.n + 1, resources_version=produced)
        return
    # Asynchronous: groups no later step may train on are planned again (consuming groups),
    # then plan what the pacing allows that is not planned yet (pinned to the version just
    # produced); the next step may be ready already: its group ran while this one trained.
    if staleness.consumes_groups(config):
        still_open = pool.replan_past(job, config, base=produced, through_n=step.n,
                                      again=step.n + 1 < config["steps"])
        if still_open:
            transaction.on_commit(lambda: _cancel_rollouts(job.project, still_open),
                                  robust=True)
    planned = set(job.steps.values_list("n", flat=True))
    for n in staleness.steps_in_flight(config, done=step.n, total=config["steps"]):
        if n not in planned:
            _step_plan(job, algorithm, n=n, resources_version=produced)
    following = job.steps.filter(n=step.n + 1).values_list("pk", flat=True).first()
    if following is not None:
        transaction.on_commit(lambda: step_check_ready(step_id=following), robust=True)


def _track_best(job: TrainingJob, step: TrainingStep, metrics: dict[str, Any]) -> None:
    """Keep the best checkpoint out of retention's reach. Rewards of step n measure the
    version its rollouts ran against; validation reward wins over training reward."""
    score = metrics.get("val_reward")
    if score is None:
        return
    if job.best_metric is not None and score <= job.best_metric:
        return
    if job.best_version is not None:
        store_services.resources_set_keep(project=job.project, resources_id=job.resources_id,
                                          version=job.best_version, keep=False)
    store_services.resources_set_keep(project=job.project, resources_id=job.resources_id,
                                      version=step.resources_version)
    job.best_version, job.best_metric = step.resources_version, score
    job.save(update_fields=["best_version", "best_metric"])


def _retain(job: TrainingJob) -> None:
    """Retention after a step: old versions go (the store keeps the best and the pinned
    ones), then the files no remaining version names."""
    deleted = store_services.resources_retain(keep_last=job_config(job)["keep_last"],
                                              project=job.project,
                                              resources_id=job.resources_id)
    if deleted:
        kept = {
            (v.resources.get("checkpoint") or {}).get("name")
            for v in selectors.job_checkpoints(job=job)
        }
        checkpoints.checkpoints_prune(name_prefix=f"jobs/{job.pk}", keep_names=kept)


def step_record_failure(*, step_id: int, attempt: int, error: str,
                        rerun_rollouts: bool = False) -> str:
    """A try that failed: back to ready and sent again while tries are left ("retry"), or
    with `rerun_rollouts` back to rolling with its rollouts planned anew; else the step and
    its job fail with the error ("failed")."""
    step = TrainingStep.objects.select_related("job").get(pk=step_id)
    if attempt < job_config(step.job)["max_step_attempts"]:
        now = _now()
        with transaction.atomic():
            moved = step_move(
                step.pk, expect=[StepStatus.TRAINING],
                to=StepStatus.ROLLING if rerun_rollouts else StepStatus.READY,
                where=Q(attempts=attempt), now=now, error=error, lease_until=None, sent_at=now)
            if moved and rerun_rollouts:
                algorithm = algorithm_load(step.job.algorithm, job_config(step.job))
                _step_plan(step.job, algorithm, n=step.n, resources_version=_replan_version(step),
                           round=step.round + 1, attempts=attempt, error=error)
            elif moved:
                transaction.on_commit(lambda: delivery.send_train_step(step.pk), robust=True)
        return "retry" if moved else "lost"
    step.refresh_from_db()
    if step.status != StepStatus.TRAINING or step.attempts != attempt:
        return "lost"
    _step_give_up(step, error)
    return "failed"


def _replan_version(step: TrainingStep) -> int:
    """The version a step's rollouts planned again pin: the same as before in a synchronous
    job; the current one (the version the step trains from) in an asynchronous job."""
    if staleness.bound(job_config(step.job)) == 0:
        return step.resources_version
    return _base_version(step)


def _step_give_up(step: TrainingStep, error: str) -> None:
    now = _now()
    message = f"step {step.n} failed after {step.attempts} tries:\n{error}"
    with transaction.atomic():
        step_move(step.pk, expect=STEP_OPEN, to=StepStatus.FAILED, now=now, error=error,
                  lease_until=None)
        TrainingJob.objects.filter(pk=step.job_id, status=JobStatus.RUNNING).update(
            status=JobStatus.FAILED, error=message, finished_at=now
        )


def job_pause(*, job_id: int) -> TrainingJob:
    """running -> paused: the sweep, the train-step task and a finishing step leave a paused
    job alone (they act on running jobs only), so it does not advance inside later, unrelated
    commands; `job_resume` goes on with it."""
    TrainingJob.objects.filter(pk=job_id, status=JobStatus.RUNNING).update(
        status=JobStatus.PAUSED
    )
    return TrainingJob.objects.get(pk=job_id)


def job_cancel(*, job_id: int) -> TrainingJob:
    """pending/running -> cancelled; open steps are cancelled and the job's unfinished
    rollouts too (runners learn it on their next report)."""
    now = _now()
    with transaction.atomic():
        TrainingJob.objects.filter(
            pk=job_id, status__in=[JobStatus.PENDING, JobStatus.RUNNING, JobStatus.PAUSED]
        ).update(status=JobStatus.CANCELLED, finished_at=now)
        open_steps = TrainingStep.objects.filter(job_id=job_id, status__in=STEP_OPEN)
        for step_id in list(open_steps.order_by("pk").values_list("pk", flat=True)):
            step_move(step_id, expect=STEP_OPEN, to=StepStatus.CANCELLED, now=now,
                      lease_until=None)
    job = TrainingJob.objects.get(pk=job_id)
    open_ids = list(
        selectors.job_rollouts(job=job).exclude(status__in=ROLLOUT_TERMINAL)
        .values_list("pk", flat=True)
    )
    _cancel_rollouts(job.project, open_ids)
    return job


def job_resume(*, job_id: int, reclaim: bool = False) -> TrainingJob:
    """Go on from the last finished step. A failed or cancelled job runs again: its
    unfinished step trains again on its rollouts when they all finished, else runs them anew.
    A running job whose processes were stopped gets its messages sent again; with `reclaim`
    (only when no training worker is alive) a step held by a dead worker is taken back now
    instead of when its lease runs out. A pending job starts."""
    job = TrainingJob.objects.get(pk=job_id)
    if job.status == JobStatus.PENDING:
        return job_start(job_id=job.pk)
    if job.status == JobStatus.SUCCEEDED:
        return job
    if job.status in (JobStatus.FAILED, JobStatus.CANCELLED):
        _reopen(job)
    elif job.status == JobStatus.PAUSED:
        _unpause(job)
    if reclaim:
        held = job.steps.filter(status=StepStatus.TRAINING).values_list("pk", flat=True)
        for step_id in list(held):
            step_move(step_id, expect=[StepStatus.TRAINING], to=None,
                      lease_until=_now() - timedelta(seconds=1))
        _release_live_attempts(job)
    _resend_queued_rollouts(job)
    steps_sweep(job_id=job.pk, force=True)
    return TrainingJob.objects.get(pk=job.pk)


def _release_live_attempts(job: TrainingJob) -> None:
    """Attempts of the job still marked live belong to runners that are gone (the caller says
    so): mark them unresponsive, as the watchdog would later, so their rollouts retry now.
    Not those whose process is known to run (`core.control.holder_alive`: a worker started
    again before the resume may already have claimed rollouts): taking them back would throw
    its work away and spend the rollouts' retries."""
    live = selectors.job_rollouts(job=job).filter(
        status__in=[RolloutStatus.PREPARING, RolloutStatus.RUNNING])
    for rollout_id, attempt, holder in live.values_list(
            "pk", "latest_attempt__attempt_id", "latest_attempt__worker_id"):
        if control.holder_alive(holder):
            continue
        try:
            store_services.attempt_update(project=job.project, rollout_id=rollout_id,
                                          attempt_id=attempt, status="unresponsive")
        except IllegalTransition:
            pass  # it reported in the meantime


def _resend_queued_rollouts(job: TrainingJob) -> None:
    """Messages of queued rollouts die with an embedded broker: send them again (the rollout
    task claims by compare-and-swap, so a message that did survive runs once anyway)."""
    queued = list(selectors.job_rollouts(job=job).filter(
        status__in=[RolloutStatus.QUEUING, RolloutStatus.REQUEUING]
    ).values_list("pk", flat=True))
    if queued:
        delivery.send_rollouts(job.project_id, queued)


def _unpause(job: TrainingJob) -> None:
    """paused -> running; a step that finished while paused did not plan the next one."""
    with transaction.atomic():
        if not TrainingJob.objects.filter(pk=job.pk, status=JobStatus.PAUSED).update(
            status=JobStatus.RUNNING
        ):
            raise JobError(f"job {job.pk} changed while resuming; try again")
        job.refresh_from_db()
        if staleness.bound(job_config(job)) > 0:
            # steps planned ahead stay as they are; what the last done step did not plan
            # (it finished while paused) is planned now, and its follower checked
            step = job.steps.filter(status=StepStatus.DONE).order_by("-n").first()
        else:
            step = job.steps.order_by("-n").first()
        if step is not None and step.status == StepStatus.DONE:
            _advance(job, step, step.produced_version, _now())


def _reopen(job: TrainingJob) -> None:
    if staleness.bound(job_config(job)) > 0:
        _reopen_async(job)
        return
    step = job.steps.order_by("-n").first()
    with transaction.atomic():
        if not TrainingJob.objects.filter(pk=job.pk, status=job.status).update(
            status=JobStatus.RUNNING, error="", finished_at=None
        ):
            raise JobError(f"job {job.pk} changed while resuming; try again")
        job.refresh_from_db()
        if step is None or step.status == StepStatus.DONE:
            if step is not None:
                _advance(job, step, step.produced_version, _now())
            return
        counts = selectors.step_rollout_counts(step=step)
        unfinished = sum(n for s, n in counts.items() if s not in ROLLOUT_TERMINAL)
        if not unfinished and not counts.get(RolloutStatus.CANCELLED):
            step_move(step.pk, expect=[step.status], to=StepStatus.READY, attempts=0, error="",
                      sent_at=_now())
            transaction.on_commit(lambda: delivery.send_train_step(step.pk), robust=True)
            return
        algorithm = algorithm_load(job.algorithm, job_config(job))
        _step_plan(job, algorithm, n=step.n, resources_version=step.resources_version,
                   round=step.round + 1)


def _reopen_async(job: TrainingJob) -> None:
    """An asynchronous job runs again: the first unfinished step trains on its rollouts when
    they all finished (the bound is checked again when it trains), else its rollouts run anew;
    the steps planned ahead of it that did not finish are planned anew, all against the
    current version, so the bound holds as in a job that never stopped."""
    with transaction.atomic():
        if not TrainingJob.objects.filter(pk=job.pk, status=job.status).update(
            status=JobStatus.RUNNING, error="", finished_at=None
        ):
            raise JobError(f"job {job.pk} changed while resuming; try again")
        job.refresh_from_db()
        done = job.steps.filter(status=StepStatus.DONE).order_by("-n").first()
        current = (done.produced_version if done is not None
                   else job.steps.get(n=0).resources_version)
        algorithm = algorithm_load(job.algorithm, job_config(job))
        unfinished = list(job.steps.exclude(status=StepStatus.DONE).order_by("n"))
        for index, step in enumerate(unfinished):
            counts = selectors.step_rollout_counts(step=step)
            rerun = (any(s not in ROLLOUT_TERMINAL for s in counts)
                     or counts.get(RolloutStatus.CANCELLED))
            if index == 0 and not rerun:
                step_move(step.pk, expect=[step.status], to=StepStatus.READY, attempts=0,
                          error="", sent_at=_now())
                transaction.on_commit(lambda s=step.pk: delivery.send_train_step(s),
                                      robust=True)
            elif not rerun:  # its group finished: it waits for its turn as it did
                step_move(step.pk, expect=[step.status], to=StepStatus.ROLLING, attempts=0,
                          error="")
            else:
                _step_plan(job, algorithm, n=step.n, resources_version=current,
                           round=step.round + 1)
        if done is not None:
            _advance(job, done, done.produced_version, _now())


@dataclass
class SweepReport:
    checked: list[int] = field(default_factory=list)  # rolling steps looked at
    ready: list[int] = field(default_factory=list)  # rolling steps moved to ready
    resent: list[int] = field(default_factory=list)  # train tasks sent again


def steps_sweep(*, now: datetime | None = None, limit: int = 100, job_id: int | None = None,
                force: bool = False) -> SweepReport:
    """The trainer's part of the periodic sweep: rolling steps whose rollouts all finished (a
    completion not acted on) or whose deadline passed become ready; ready steps whose task
    never started and steps whose training worker died (lease expired) are sent again.
    Bounded per call; `force` re-sends without waiting `resend_seconds` (used when resuming)."""
    now = now or _now()
    report = SweepReport()
    # Served by the partial index trainingstep_open.
    steps = TrainingStep.objects.filter(status__in=STEP_OPEN, job__status=JobStatus.RUNNING)
    if job_id is not None:
        steps = steps.filter(job_id=job_id)
    for step in steps.select_related("job").order_by("updated_at")[:limit]:
        if step.status == StepStatus.ROLLING:
            report.checked.append(step.pk)
            if step_check_ready(step_id=step.pk, now=now):
                report.ready.append(step.pk)
        elif _resend_due(step, now, force):
            report.resent.append(step.pk)
    return report


def _resend_due(step: TrainingStep, now: datetime, force: bool) -> bool:
    wait = timedelta(seconds=0 if force else job_config(step.job)["resend_seconds"])
    due = Q(status=StepStatus.READY) | Q(status=StepStatus.TRAINING, lease_until__lt=now)
    sent_before = Q(sent_at__isnull=True) | Q(sent_at__lte=now - wait)
    moved = step_move(step.pk, expect=[StepStatus.READY, StepStatus.TRAINING], to=None,
                      where=due & sent_before, now=now, sent_at=now)
    if moved:
        delivery.send_train_step(step.pk)
    return bool(moved)



def steps_take_over(node: str, pid: int) -> int:
    """A Celery worker starting under node name `node` takes back the steps that dead
    processes of that node hold ("celery:<node>:<pid>"): their lease ends now and their train
    task is sent again (Redis would give the killed worker's message back only after its
    visibility timeout). A process id alive again (reused) is left to its lease."""
    prefix = f"celery:{node}:"
    now = _now()
    taken = 0
    held = TrainingStep.objects.filter(status=StepStatus.TRAINING, worker__startswith=prefix,
                                       job__status=JobStatus.RUNNING).select_related("job")
    for step in held.order_by("pk"):
        holder = step.worker[len(prefix):]
        if not holder.isdigit() or int(holder) == pid or process_alive(int(holder)):
            continue
        if step_move(step.pk, expect=[StepStatus.TRAINING], to=None,
                     where=Q(worker=step.worker, attempts=step.attempts), now=now,
                     lease_until=now - timedelta(seconds=1)):
            step.refresh_from_db()
            taken += _resend_due(step, now, force=True)
    return taken


def steps_redispatch() -> int:
    """The reconciler the control sweep runs (core.control): how many steps it moved
    to ready or sent again."""
    report = steps_sweep()
    return len(report.ready) + len(report.resent)
