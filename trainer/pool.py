"""What an asynchronous job's step trains on when it consumes groups (config `consume`
"groups", the default with `max_staleness` > 0; README "Asynchronous training").

The unit is a group of train rollouts trained together or not at all: GRPO's rollouts of one
task in one round of one step's plan (staleness.Unit). The step that trains from version v
takes the first complete units within the bound, oldest first (plan order), wherever they
were planned: its own, ones a slow episode held back at earlier steps, or ones of the steps
planned ahead; as many as its own plan holds. A unit that has aged past the bound before a
step took it is planned again against the current version (a new round of the step that
planned it, counted on that step), never dropped. What each step trained on is stored
(`TrainingStep.trained`), so the bound can be checked from the rows. Step 0 also plans the
job's spare groups (config `spare_groups`), so the pool holds more groups than the steps
need and the last steps do not wait for the slowest; those left when training ends are
counted on the job (`surplus_groups`) and their open rollouts cancelled.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.db.models import F

from store import services as store_services
from store.services import RolloutSpec
from store.statemachine import ROLLOUT_TERMINAL
from trainer import conventions as c
from trainer import delivery, selectors, staleness
from trainer.algorithms import Algorithm, FinishedRollout, PlannedRollout
from trainer.models import GROUP_OWNER, StepStatus, TrainingJob, TrainingStep, group_key


def rollouts_send(job: TrainingJob, group: Any, specs: list[RolloutSpec]) -> list[str]:
    """Enqueue `specs` into `group` (inside the caller's transaction), mark them for Celery
    delivery and send them after commit (the sweep sends again what a lost message left)."""
    rollouts = store_services.rollout_enqueue_many(project=job.project, specs=specs,
                                                   group=group, party=selectors.job_party(job))
    marked = store_services.rollout_dispatch_set(
        project=job.project, rollout_ids=[r.pk for r in rollouts],
        dispatch=delivery.CELERY_DISPATCH, target=job.agent,
    )
    ids = [d.rollout_id for d in marked]
    transaction.on_commit(lambda: delivery.send_rollouts(job.project_id, ids), robust=True)
    return ids


def rollout_metadata(job: TrainingJob, config: dict[str, Any], n: int, *,
                     spare: bool = False) -> dict[str, Any]:
    """A planned rollout's metadata: its job and step, and for a job consuming groups
    `trainer.pool` (its finishing may make the next step ready: trainer/reactions.py) and,
    for a spare group's, `trainer.spare`; for partial rollouts `lightning.llm.latest` (the
    gateway serves each call with the newest version)."""
    metadata: dict[str, Any] = {"trainer.job": job.pk, "trainer.step": n}
    if staleness.consumes_groups(config):
        metadata["trainer.pool"] = True
    if spare:
        metadata[staleness.SPARE] = True
    if staleness.partial_rollouts(config):
        metadata[c.LLM_LATEST] = True
    return metadata


def planned_units(step: TrainingStep) -> int:
    """How many units the step's own plan (current round) holds, spare groups left out: how
    many it trains on."""
    keys = set()
    for pk, mode, task, metadata in selectors.step_rollouts(step=step).values_list(
            "pk", "mode", "input__group", "metadata"):
        if (mode or "train") == "train" and not _spare(metadata):
            keys.add(task if task is not None else pk)
    return len(keys)


def _spare(metadata: Any) -> bool:
    return isinstance(metadata, dict) and metadata.get(staleness.SPARE) is True


def spare_plan(algorithm: Algorithm, job: TrainingJob, config: dict[str, Any],
               planned: list[PlannedRollout]) -> list[PlannedRollout]:
    """The job's spare groups (config `spare_groups`, default half of step 0's own groups),
    planned with step 0 beside its own plan `planned`: the first train units of the plans
    of the steps after the last one (`steps`, `steps` + 1, ...: seeds no step uses, so every
    run plans the same ones), leaving out tasks step 0 plans itself (their rollouts would
    join its units)."""
    own = {_task(p) for p in planned if p.mode == "train"}
    want = staleness.spare_groups(config, planned=len(own))
    if not want:
        return []
    units: dict[Any, list[PlannedRollout]] = {}
    for n in range(config["steps"], config["steps"] + want + 1):
        fresh: dict[Any, list[PlannedRollout]] = defaultdict(list)
        for p in algorithm.plan(step=n, final=False, train_dataset=job.train_dataset,
                                val_dataset=job.val_dataset):
            if p.mode == "train" and _task(p) not in own and _task(p) not in units:
                fresh[_task(p)].append(p)
        for task, rollouts in fresh.items():
            if len(units) < want:
                units[task] = rollouts
    return [p for rollouts in units.values() for p in rollouts]


def _task(planned: PlannedRollout) -> Any:
    group = planned.input.get("group") if isinstance(planned.input, dict) else None
    return group if group is not None else id(planned)


def _horizon(step: TrainingStep, config: dict[str, Any]) -> int:
    return step.n + staleness.steps_ahead(config)


def ready(step: TrainingStep, config: dict[str, Any], *, base: int) -> bool:
    """The step (its turn come) may train: its own validation rollouts finished and enough
    complete units within the bound exist (by their pins; spans are read when it trains)."""
    if selectors.step_rollouts(step=step).exclude(mode="train").exclude(
            status__in=ROLLOUT_TERMINAL).exists():
        return False
    need = planned_units(step)
    units, _ = selectors.pool_units(job=step.job, through_n=_horizon(step, config))
    found = staleness.units_pick(units, base=base, limit=staleness.bound(config), count=need)
    return len(found) >= need


@dataclass
class Picked:
    """What the step trains on: the units and their finished rollouts (plan order), and how
    many complete units of its own plan are past the bound by their spans."""

    units: list[staleness.Unit] = field(default_factory=list)
    rollouts: list[FinishedRollout] = field(default_factory=list)
    own_past: int = 0

    @property
    def rollout_ids(self) -> list[str]:
        return [r.rollout_id for r in self.rollouts]


def pick(step: TrainingStep, config: dict[str, Any], *, base: int) -> Picked:
    """The first complete units within the bound, oldest first, as many as the step planned;
    versions read from the rollouts' pins and LLM spans."""
    limit = staleness.bound(config)
    units, finished = selectors.pool_units(job=step.job, through_n=_horizon(step, config),
                                           spans=True)
    chosen = staleness.units_pick(units, base=base, limit=limit, count=planned_units(step))
    own_past = sum(1 for u in staleness.units_past(units, base=base, limit=limit)
                   if u.complete and u.key[0] == step.group_id)
    return Picked(chosen, [finished[i] for u in chosen for i in u.rollout_ids], own_past)


def replan_past(job: TrainingJob, config: dict[str, Any], *, base: int, through_n: int,
                again: bool = True) -> list[str]:
    """Inside the transaction that made step `through_n` done: every unit of a done step
    that the next step (training from `base`) may not train on is planned again against the
    current version, as a new round of the step that planned it (its other units were
    trained on: nothing else is in that round), and counted there (`stale_replans`,
    `stale_rollouts`); a spare group stays spare. Without `again` (the last training step is
    done) nothing is planned: every group left untrained (the spare groups' worth: as many
    as the job planned beyond what its steps train on) is counted on the job
    (`surplus_groups`, `surplus_rollouts`). Returns the ids of the old rollouts still open,
    to cancel after commit."""
    units, _ = selectors.pool_units(job=job, through_n=through_n)
    past = (staleness.units_past(units, base=base, limit=staleness.bound(config)) if again
            else units)
    by_group: dict[int, list[staleness.Unit]] = {}
    for unit in past:
        by_group.setdefault(unit.key[0], []).append(unit)
    still_open: list[str] = []
    for step in TrainingStep.objects.filter(job=job, group_id__in=list(by_group),
                                            status=StepStatus.DONE).order_by("n"):
        ids = [i for u in by_group[step.group_id] for i in u.rollout_ids]
        rows = list(selectors.step_rollouts(step=step).filter(pk__in=ids)
                    .values("pk", "input", "status", "metadata").order_by("start_time", "pk"))
        still_open += [r["pk"] for r in rows if r["status"] not in ROLLOUT_TERMINAL]
        if not again:
            TrainingJob.objects.filter(pk=job.pk).update(
                surplus_groups=F("surplus_groups") + len(by_group[step.group_id]),
                surplus_rollouts=F("surplus_rollouts") + len(rows))
            continue
        group, created = store_services.group_create(
            project=job.project, key=group_key(step.pk, step.round + 1), owner=GROUP_OWNER)
        if created:
            rollouts_send(job, group, [
                RolloutSpec(input=r["input"], mode="train", resources_id=job.resources_id,
                            config=config["rollout_config"],
                            metadata=rollout_metadata(job, config, step.n,
                                                      spare=_spare(r["metadata"])))
                for r in rows])
        TrainingStep.objects.filter(pk=step.pk).update(
            round=F("round") + 1, group=group, stale_replans=F("stale_replans") + 1,
            stale_rollouts=F("stale_rollouts") + len(rows))
    return still_open
