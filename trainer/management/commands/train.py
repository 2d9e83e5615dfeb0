"""`manage.py train TARGET`: create a training job and run it.

TARGET names a job spec (trainer/specs.py): a module with a `job_spec(seed=..., steps=...)`
function (e.g. `examples.cipher`), the dotted path of such a function, a Python file defining
it, or a JSON file holding the spec; it is checked before the job is created. On the embedded
default (no DATABASE_URL, no CELERY_BROKER_URL) the rollout and training workers and the sweep
run in this process; otherwise the job is submitted to the deployment's workers and
followed.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from typing import TextIO

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from core.console import (
    Terminated,
    command_hint,
    progress_stream,
    quiet_libraries,
    sigterm_as_interrupt,
)
from core.embedded import embedded_workers
from core.queues import Queue
from store import services as store_services
from store.errors import InvalidInput
from store.models import Project
from trainer import progress, selectors, services, specs
from trainer.algorithms import algorithm_class
from trainer.llm.embedded import embedded_gateway
from trainer.models import JobStatus, TrainingJob


def project_named(name: str) -> Project:
    return Project.objects.filter(name=name).first() or store_services.project_create(name=name)


def run_followed(job_id: int, *, start: bool, reclaim: bool = False, quiet: bool = False,
                 out: TextIO | None = None, concurrency: Mapping[str, int] | None = None
                 ) -> progress.Snapshot:
    """Start (or resume) and follow; with in-process workers on the embedded default
    (`concurrency`: threads per queue there)."""
    def go() -> progress.Snapshot:
        if start:
            services.job_start(job_id=job_id)
        else:
            services.job_resume(job_id=job_id, reclaim=reclaim)
        try:
            return progress.follow(job_id, disable=quiet, file=out)
        except KeyboardInterrupt:
            # The interrupt may have landed inside a query, past Django's cleanup, leaving a
            # statement open (on SQLite, a stale read snapshot that refuses any write): this
            # thread's connections are dropped, and the pause starts on a fresh one.
            connections.close_all()
            # Paused before the embedded workers stop, so nothing plans its next step.
            services.job_pause(job_id=job_id)
            raise

    if settings.EMBEDDED_WORKERS:
        with contextlib.ExitStack() as stack:
            if _serves_llm(job_id):  # its agents call the model: the gateway runs here too
                stack.enter_context(embedded_gateway())
                concurrency = {Queue.ROLLOUTS: settings.EMBEDDED_LLM_ROLLOUT_CONCURRENCY,
                               **(concurrency or {})}
            stack.enter_context(embedded_workers(concurrency=concurrency))
            return go()
    return go()


def leftover_notice(job_id: int) -> str | None:
    """Jobs other than ours that an earlier command left running (killed without a chance
    to pause them): this process's workers would advance them too, so say so."""
    others = list(TrainingJob.objects.filter(status=JobStatus.RUNNING).exclude(pk=job_id)
                  .order_by("pk").values_list("pk", flat=True))
    if not others:
        return None
    ids = ", ".join(str(pk) for pk in others)
    return (f"note: job(s) {ids} were left running by an earlier command and will advance "
            f"here too; {command_hint('train_cancel N')} stops one for good")


def interrupted(job_id: int, how: KeyboardInterrupt | None = None) -> CommandError:
    """What Ctrl+C (130) or SIGTERM (143) ends a following command with: the job is paused,
    and how to go on."""
    return CommandError(f"job {job_id} paused; go on with {command_hint(f'train_resume {job_id}')}",
                        returncode=143 if isinstance(how, Terminated) else 130)


def _serves_llm(job_id: int) -> bool:
    job = TrainingJob.objects.get(pk=job_id)
    return algorithm_class(job.algorithm).serves_llm


def summary(snap: progress.Snapshot, seconds: float, threshold: float | None) -> str:
    job = snap.job
    lines = [f"job {job.pk}: {job.status} after {seconds:.1f}s, {snap.steps_done} steps done"]
    if snap.train_reward is not None:
        lines.append(f"mean train reward of the last step: {snap.train_reward:.3f}")
    first = job.steps.filter(n=0).values_list("metrics", flat=True).first() or {}
    if "val_reward" in first and snap.val_reward is not None:
        lines.append(f"validation reward {first['val_reward']:.3f} (untrained) -> "
                     f"{snap.val_reward:.3f} (final)")
    if threshold is not None and snap.val_reward is not None:
        verdict = "reached" if snap.val_reward >= threshold else "NOT reached"
        reached = selectors.job_threshold_reached(job=job)
        if reached is not None:
            verdict += (f" (first at step {reached.step}, {reached.seconds:.1f}s after the job "
                        "started)")
        lines.append(f"threshold {threshold}: {verdict}")
    if job.best_version is not None:
        lines.append(f"best checkpoint: {job.resources_id} version {job.best_version}")
    if job.error:
        lines.append(job.error)
    return "\n".join(lines)


class Command(BaseCommand):
    help = "Create a training job from a job spec and run it, showing progress."

    def add_arguments(self, parser) -> None:
        parser.add_argument("target", help="job spec: a module defining job_spec(), the "
                            "dotted path of such a function, a .py file defining job_spec(), "
                            "or a .json file holding the spec (README 'Job specs')")
        parser.add_argument("--steps", type=int, help="training steps (the spec's default)")
        parser.add_argument("--seed", type=int, default=None,
                            help="seed of the spec and model (0)")
        parser.add_argument("--project", default="default",
                            help="project of the job, made if missing (default)")
        parser.add_argument("--algorithm", help="override the spec's algorithm")
        parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                            help="override one config value, e.g. --set lr=0.1")
        parser.add_argument("--world-size", type=int, metavar="N",
                            help="processes of each training step (DDP; config world_size, 1)")
        parser.add_argument("--parallel", choices=["ddp", "fsdp"],
                            help="how those processes share the model (config parallel, ddp)")
        parser.add_argument("--nodes", type=int, metavar="M",
                            help="training workers that run each step together, world-size/M "
                                 "ranks each (a gang; config nodes, 1; distributed mode only)")
        parser.add_argument("--no-follow", action="store_true",
                            help="submit and return (distributed mode only)")
        parser.add_argument("--quiet", action="store_true", help="no progress bar")

    def handle(self, *args, **opts) -> None:
        quiet_libraries(opts["verbosity"])
        if opts["no_follow"] and settings.EMBEDDED_WORKERS:
            raise CommandError("--no-follow needs the distributed mode (DATABASE_URL and a "
                               "broker, README 'Distributed'): on the embedded default the "
                               "workers run inside this command")
        try:
            spec = specs.spec_build(specs.spec_load(opts["target"]), where=opts["target"],
                                    seed=opts["seed"], steps=opts["steps"])
        except specs.SpecError as exc:
            raise CommandError(str(exc)) from None
        config = spec["config"]
        for item in opts["set"]:
            key, sep, raw = item.partition("=")
            if not key or not sep:
                raise CommandError(f"--set {item!r}: expected KEY=JSON, e.g. --set lr=0.1")
            try:
                config[key] = json.loads(raw)
            except json.JSONDecodeError:
                config[key] = raw
        if opts["world_size"] is not None:
            config["world_size"] = opts["world_size"]
        if opts["parallel"] is not None:
            config["parallel"] = opts["parallel"]
        if opts["nodes"] is not None:
            config["nodes"] = opts["nodes"]
        nodes = config.get("nodes", 1)
        if isinstance(nodes, int) and nodes > 1 and settings.EMBEDDED_WORKERS:
            raise CommandError("nodes > 1 needs as many training workers (a gang, README "
                               "'A step across nodes'): the embedded default runs one; set "
                               "DATABASE_URL and a broker")
        try:
            job = services.job_create(
                project=project_named(opts["project"]), agent=spec["agent"],
                algorithm=opts["algorithm"] or spec["algorithm"], config=config,
                train_dataset=spec["train_dataset"], val_dataset=spec.get("val_dataset") or [],
                name=spec.get("name") or "",
            )
        except InvalidInput as exc:
            raise CommandError(str(exc)) from None
        mode = "embedded" if settings.EMBEDDED_WORKERS else "distributed"
        self.stdout.write(f"job {job.pk} created ({mode} mode)")
        if opts["no_follow"] and not settings.EMBEDDED_WORKERS:
            try:
                services.job_start(job_id=job.pk)
            except services.JobError as exc:
                raise CommandError(str(exc)) from None
            self.stdout.write("submitted; follow it with "
                              f"{command_hint(f'train_show {job.pk} --follow')}")
            return
        notice = leftover_notice(job.pk) if settings.EMBEDDED_WORKERS else None
        if notice:
            self.stdout.write(notice)
        started = time.monotonic()
        try:
            with sigterm_as_interrupt():
                snap = run_followed(job.pk, start=True, quiet=opts["quiet"],
                                    out=progress_stream(self.stdout))
        except KeyboardInterrupt as how:
            raise interrupted(job.pk, how) from None
        except services.JobError as exc:  # it could not start: failed, with the reason
            raise CommandError(str(exc)) from None
        self.stdout.write(summary(snap, time.monotonic() - started, config.get("threshold")))
        if snap.job.status != "succeeded":
            raise CommandError(f"job {job.pk} {snap.job.status}")


def job_or_error(job_id: int) -> TrainingJob:
    job = TrainingJob.objects.filter(pk=job_id).first()
    if job is None:
        raise CommandError(f"no job {job_id}")
    return job
