"""A step across nodes: a gang of `nodes` training workers, world_size / nodes ranks each
(issue 25).

Every training worker of the gang takes one train-step message (a gang step's is sent
`nodes` times) and joins the try it gathers for: a `GangMember` row under the smallest free
node rank, written with the step's row locked. Node 0's worker serves a TCPStore (a port the
kernel picks) on `TRAINING_GANG_ADDR` and writes the address on its row. The member that
finds `nodes` rows and the address claims the step for all of them in the same locked
transaction (`services.step_claim`: one try counted, a lease, node 0's worker the holder);
until then nothing starts. A member that waited `gang_wait_seconds` without the gang forming
deletes its row and returns: the step stays `ready` with the reason shown (train_show,
queue_watch, the job page), and the trainer sweep sends it again.

Once started, each member runs its local ranks (global ranks node_rank x local ...) on the
step's samples read from the store, all meeting at node 0's TCPStore (gloo on the CPU, NCCL
when every node has the GPUs). Rank 0 (node 0) alone hands the update back; node 0's worker
saves the checkpoint and finishes the step through the usual compare-and-swap. Every two
seconds each member writes its heartbeat and checks its peers: a peer on this host whose
process is gone, a peer silent for `gang_peer_timeout_seconds`, or a try that is no longer
this one stops its ranks and records the failure (the one that records first moves the step
back to `ready` for a new try, the others find it lost): every member's try fails, none
outlives it, and the step is redone with versions kept one per step.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import DateTimeField, ExpressionWrapper
from django.db.models.functions import Now
from django.utils import timezone

from core import devices
from core.processes import process_alive
from core.retry import DEFAULT as DB_RETRY
from core.retry import RetryPolicy
from core.usage import CpuMeter
from trainer import distributed, services
from trainer.lease import lease_kept
from trainer.models import GangMember, JobStatus, StepStatus, TrainingStep

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25


def step_train(*, step_id: int, worker: str, retry: RetryPolicy = DB_RETRY) -> str:
    """The train-step task's body: a gang member's part of a multi-node step, else
    services.step_train. Returns what happened: done, member (this node's ranks did their
    part, node 0 finishes), released (the gang did not form), quota (its project's GPU quota
    is reached: services.step_quota_wait), skipped, retry, failed, lost."""
    config = _gang_config(step_id)
    if config is None:
        return services.step_train(step_id=step_id, worker=worker, retry=retry)
    if (held := services.step_quota_wait(step_id)) is not None:
        return held  # before joining: no place taken in a gang that could not start
    meter = CpuMeter()
    member = gang_join(step_id=step_id, worker=worker)
    if member is None:
        return "skipped"
    store = None
    if member.node_rank == 0:
        try:
            store = _serve(member, config, retry)
        except Exception:  # no address to serve on: this worker gives its place back
            retry.call(lambda: gang_release(member_id=member.pk),
                       what=f"step {step_id}: leaving its gang")
            raise
    try:
        step = _gather(member, config, retry)
        if step is None:
            return "released"
        return _run(member, step, meter, retry)
    finally:
        del store  # node 0: the try's TCPStore closes with it


def _serve(member: GangMember, config: dict[str, Any], retry: RetryPolicy) -> Any:
    """Node 0: open the gang's TCPStore and write where it is on this member's row."""
    addr = gang_addr()
    store, port = distributed.master_store(addr, float(config["gang_wait_seconds"]) + 60)
    local = distributed.world_size_of(config) // distributed.nodes_of(config)
    retry.call(lambda: gang_master_set(member_id=member.pk, addr=addr, port=port,
                                       backend=distributed.backend_for(local)),
               what=f"step {member.step_id}: the gang's address")
    return store


def gang_addr() -> str:
    """Where this worker serves the gang's TCPStore as node 0: `TRAINING_GANG_ADDR`, or with
    "hostname" this host's name resolved (a container's own address under compose)."""
    addr = settings.TRAINING_GANG_ADDR
    return socket.gethostbyname(socket.gethostname()) if addr == "hostname" else addr


def _gang_config(step_id: int) -> dict[str, Any] | None:
    """The job's config when the step trains as a gang; None when one worker runs it (one
    node, or the final step, which only evaluates: the others' messages find it done)."""
    step = TrainingStep.objects.select_related("job").filter(pk=step_id).first()
    if step is None:
        return None
    config = services.job_config(step.job)
    if distributed.nodes_of(config) <= 1 or step.n >= config["steps"]:
        return None
    return config


def gang_join(*, step_id: int, worker: str, now: datetime | None = None) -> GangMember | None:
    """This worker's place in the gang gathering for the step's next try, under the smallest
    free node rank; None when the step is not waiting for a gang (done, training under a live
    lease, its job not running), the gang is full, this worker is in it already, or its
    devices do not fit the job's `resources` (per node)."""
    now = now or timezone.now()
    step = TrainingStep.objects.select_related("job").filter(pk=step_id).first()
    if step is not None and step.attempts >= services.job_config(step.job)["max_step_attempts"]:
        # tried too often: step_claim gives the job up (outside the step's lock below: it
        # writes the job's row, and the lock order is job, then step)
        services.step_claim(step_id=step.pk, worker=worker, now=now)
        return None
    with transaction.atomic():
        step = (TrainingStep.objects.select_for_update().select_related("job")
                .filter(pk=step_id).first())
        if step is None or step.job.status != JobStatus.RUNNING:
            return None
        config = services.job_config(step.job)
        expired = step.lease_until is not None and step.lease_until < now
        if not (step.status == StepStatus.READY or step.status == StepStatus.TRAINING and (
                expired or services.holder_dead(step, worker))):
            return None
        if step.attempts >= config["max_step_attempts"]:
            return None
        need = devices.resources_parse(config.get("resources"))
        if need.any and not devices.fits(devices.local_devices(), need):
            log.info("step %s needs %s per node; %s does not have it", step.pk,
                     need.describe(), worker)
            return None
        attempt = step.attempts + 1
        _drop_silent(step, attempt, config)
        members = GangMember.objects.filter(step=step, attempt=attempt)
        taken = {m.node_rank: m.worker for m in members}
        nodes = distributed.nodes_of(config)
        if worker in taken.values() or len(taken) >= nodes:
            return None
        rank = min(set(range(nodes)) - set(taken))
        return GangMember.objects.create(
            step=step, attempt=attempt, node_rank=rank, worker=worker,
            host=socket.gethostname(), pid=os.getpid(), joined_at=now, seen_at=Now())


def gang_master_set(*, member_id: int, addr: str, port: int, backend: str) -> None:
    """Node 0's worker: where the gang meets (its TCPStore) and the backend every rank uses."""
    GangMember.objects.filter(pk=member_id, node_rank=0).update(
        master_addr=addr, master_port=port, backend=backend)


def gang_start(*, member_id: int, now: datetime | None = None) -> str:
    """One look at the gang: "started" (the step's try is this gang's: claimed now, by this
    call, or by another member), "waiting" (members or node 0's address missing), or "lost"
    (this row is gone, or another try took the step)."""
    now = now or timezone.now()
    with transaction.atomic():
        member = GangMember.objects.filter(pk=member_id).first()
        if member is None:
            return "lost"
        step = (TrainingStep.objects.select_for_update().select_related("job")
                .get(pk=member.step_id))
        if step.attempts >= member.attempt:
            ours = step.attempts == member.attempt and step.status == StepStatus.TRAINING
            return "started" if ours else "lost"
        GangMember.objects.filter(pk=member.pk).update(seen_at=Now())
        _drop_silent(step, member.attempt, services.job_config(step.job))
        members = list(GangMember.objects.filter(step=step, attempt=member.attempt)
                       .order_by("node_rank"))
        nodes = distributed.nodes_of(services.job_config(step.job))
        if len(members) < nodes or members[0].master_port is None:
            return "waiting"
        # Every node is here: the try is claimed for all of them (the step's row is locked).
        claimed = services.step_claim(step_id=step.pk, worker=members[0].worker, now=now)
        return "started" if claimed is not None else "lost"


def _drop_silent(step: TrainingStep, attempt: int, config: dict[str, Any]) -> None:
    """A gathering member polls every quarter second; one silent for
    `gang_peer_timeout_seconds` died while it waited (kill -9): its place is freed, so the
    gang never starts with it and its node rank (0 too) goes to the next worker."""
    GangMember.objects.filter(step=step, attempt=attempt,
                              seen_at__lt=_ago(float(config["gang_peer_timeout_seconds"]))
                              ).delete()


def _ago(seconds: float) -> ExpressionWrapper:
    """The database's clock `seconds` ago: heartbeats are written and compared on the one
    clock, so members on hosts whose clocks differ agree on who is silent."""
    return ExpressionWrapper(Now() - timedelta(seconds=seconds), output_field=DateTimeField())


def gang_release(*, member_id: int) -> bool:
    """A member that waited long enough gives its place back; False when the gang started
    in the meantime (it then trains)."""
    with transaction.atomic():
        member = GangMember.objects.filter(pk=member_id).first()
        if member is None:
            return True
        step = TrainingStep.objects.select_for_update().get(pk=member.step_id)
        if step.attempts >= member.attempt:
            return False
        member.delete()
        return True


def _gather(member: GangMember, config: dict[str, Any],
            retry: RetryPolicy) -> TrainingStep | None:
    """Wait for the gang; the claimed step, or None when this member gave its place back."""
    deadline = time.monotonic() + float(config["gang_wait_seconds"])
    while True:
        state = retry.call(lambda: gang_start(member_id=member.pk),
                           what=f"step {member.step_id}: gathering its gang")
        if state == "started":
            return TrainingStep.objects.select_related("job").get(pk=member.step_id)
        if state == "lost":
            return None
        if time.monotonic() > deadline and retry.call(
                lambda: gang_release(member_id=member.pk),
                what=f"step {member.step_id}: leaving its gang"):
            log.info("step %s: gang of %s did not form in %ss; %s left it", member.step_id,
                     distributed.nodes_of(config), config["gang_wait_seconds"], member.worker)
            return None
        time.sleep(POLL_SECONDS)


def _run(member: GangMember, step: TrainingStep, meter: CpuMeter, retry: RetryPolicy) -> str:
    outcome, picked = services.step_precheck(step, retry)
    if outcome is not None:
        return outcome  # every member looks; one acts, before any rank starts
    config = services.job_config(step.job)
    members = list(GangMember.objects.filter(step=step, attempt=member.attempt)
                   .order_by("node_rank"))
    nodes = len(members)
    local = distributed.world_size_of(config) // nodes
    master = members[0]
    meet = distributed.Rendezvous(
        world_size=local * nodes, local=local, backend=master.backend or "gloo",
        offset=member.node_rank * local, host=master.master_addr,
        port=int(master.master_port or 0),
        timeout_seconds=float(config["gang_peer_timeout_seconds"]) + 60)
    peers = [m for m in members if m.pk != member.pk]
    abort = _watch(member, peers, float(config["gang_peer_timeout_seconds"]))

    def run_update(algorithm: Any, n: int, state: dict[str, Any],
                   samples: list[Any]) -> tuple[Any, str, int]:
        update = distributed.run_ranks(algorithm, meet, step=n, state=state, samples=samples,
                                       abort=abort)
        device = "cuda" if meet.backend == "nccl" else "cpu"
        label = f"{device} x{meet.world_size} ({nodes} nodes)"
        return update, label, local if device == "cuda" else 0

    try:
        with lease_kept(step, config["step_lease_seconds"]):
            result = services.train_run(step, run_update, picked)
    except Exception:
        error = f"gang node {member.node_rank} ({member.worker}):\n" + traceback.format_exc(
            limit=8)
        log.warning("step %s: try %s failed on %s", step.pk, member.attempt, error)
        return retry.call(lambda: services.step_record_failure(
            step_id=step.pk, attempt=member.attempt, error=error),
            what=f"step {step.pk}: recording a failure")
    usage = services.step_usage(meter, result)
    if member.node_rank != 0:
        retry.call(lambda: services.step_record_member_usage(
            step=step, attempt=member.attempt, usage=usage),
            what=f"step {step.pk}: gang node {member.node_rank}'s usage")
        return "member"
    return retry.call(lambda: services.step_finish(step, result, usage),
                      what=f"step {step.pk}: finishing")


def _watch(member: GangMember, peers: list[GangMember], silent_seconds: float):
    """The check `run_ranks` asks every two seconds: write this member's heartbeat, then why
    the try cannot go on (None while it can)."""
    here = socket.gethostname()

    def check() -> str | None:
        try:
            GangMember.objects.filter(pk=member.pk).update(seen_at=Now())
            # DONE: node 0 finished the try while this node's ranks were leaving (their
            # last collective is behind them): nothing to stop.
            if not TrainingStep.objects.filter(
                    pk=member.step_id, attempts=member.attempt,
                    status__in=[StepStatus.TRAINING, StepStatus.DONE]).exists():
                return f"try {member.attempt} of the step ended on another node"
            silent = set(GangMember.objects.filter(pk__in=[p.pk for p in peers],
                                                   seen_at__lt=_ago(silent_seconds))
                         .values_list("pk", flat=True))
        except Exception:  # the database is briefly away: look again next time
            log.warning("step %s: could not check its gang", member.step_id, exc_info=True)
            return None
        for peer in peers:
            if peer.host == here and not process_alive(peer.pid):
                return f"gang node {peer.node_rank} ({peer.worker}) died"
            if peer.pk in silent:
                return (f"gang node {peer.node_rank} ({peer.worker}) silent for more than "
                        f"{silent_seconds:g}s")
        return None

    return check
