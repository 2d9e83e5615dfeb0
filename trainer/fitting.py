"""`fit()`: a Python entry point for notebooks and scripts, in the spirit of AGL's
`Trainer.fit`, over the same job machinery as `manage.py train`.

    from trainer import fit
    job = fit(agent="examples.cipher.agent.cipher_agent", algorithm="grpo",
              train_dataset=tasks, val_dataset=held_out, n_runners=4, config={"steps": 5})
    job.status, job.best_version, [s.metrics for s in job.steps.order_by("n")]

On the embedded default (no DATABASE_URL) it migrates the SQLite file and runs the job with
in-process workers (`n_runners` rollout threads); with DATABASE_URL and a broker it submits
the job to the deployment's workers and follows it. AGL_CURRENT_ROLE is honoured as AGL's
Trainer honours it: `algorithm` runs no rollout workers here (runners elsewhere serve them);
`runner` is for runner processes, which `manage.py runner` (or a Celery rollouts worker) is.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import django
from django.apps import apps
from django.conf import settings
from django.core.management import call_command

from core import agl_roles
from core.queues import Queue


def fit(
    *, agent: str | Callable[..., Any] | type, train_dataset: Sequence[Any],
    algorithm: str = "grpo", val_dataset: Sequence[Any] | None = None,
    n_runners: int | None = None, config: dict[str, Any] | None = None, name: str = "",
    project: str = "default", progress: bool = False,
) -> Any:
    """Create a training job, run it to its end and return it (a `TrainingJob`, its steps'
    metrics under `job.steps`). `agent` is a dotted path or the agent itself (a function, an
    `@agl.rollout` agent, a class), which must be importable by that path."""
    _setup_django()
    # After setup: models cannot be imported before Django's app registry is ready.
    from trainer.management.commands.train import project_named, run_followed
    from trainer.services import job_create

    role = agl_roles.current_role()
    if role == agl_roles.Role.RUNNER:
        raise RuntimeError("AGL_CURRENT_ROLE=runner: run `manage.py runner --agent PATH` "
                           "(store at AGL_SERVER_HOST:AGL_SERVER_PORT) instead of fit()")
    job = job_create(
        project=project_named(project), agent=agent_path(agent), algorithm=algorithm,
        config=dict(config or {}), train_dataset=list(train_dataset),
        val_dataset=list(val_dataset or []), name=name,
    )
    concurrency = {str(Queue.ROLLOUTS): n_runners} if n_runners else None
    snap = run_followed(job.pk, start=True, quiet=not progress, concurrency=concurrency)
    return snap.job


def agent_path(agent: str | Callable[..., Any] | type) -> str:
    """The dotted path our workers load the agent by."""
    if isinstance(agent, str):
        return agent
    target = agent if hasattr(agent, "__qualname__") else type(agent)
    path = f"{target.__module__}:{target.__qualname__}"
    if "<" in path or target.__module__ == "__main__":
        raise ValueError(f"{path!r}: fit() needs an agent importable by its dotted path "
                         "(define it in a module, not in __main__ or a function)")
    return path


def _setup_django() -> None:
    if not settings.configured:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")
    if not apps.ready:
        django.setup()
    if settings.EMBEDDED_WORKERS:
        # The embedded default's SQLite file, brought up to date as `./lightning` does.
        call_command("migrate", verbosity=0, interactive=False)
