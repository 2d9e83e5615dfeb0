from __future__ import annotations

from django.apps import AppConfig
from django.core import checks

from core import embedded
from core.celery import app as celery_app
from core.control import register_holder_alive, register_takeover, register_worker_devices
from core.publish import register_options, register_target_check
from core.queues import Queue
from core.scaling import register_backlog
from runners.checks import check_settings


class RunnersConfig(AppConfig):
    name = "runners"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        checks.register(check_settings)
        # Every worker of this app registers itself (host, queues, CPUs, CUDA) and heartbeats.
        celery_app.steps["worker"].add("runners.worker_registry:WorkerRegistryStep")
        # After a broker outage, each worker sends the messages owed meanwhile as it reconnects.
        celery_app.steps["consumer"].add("runners.worker_registry:ResendOnReconnectStep")
        # Django's documented place for wiring that needs models: they load only after the
        # app registry is ready, which is why this import is here and not at the top.
        from runners import selectors, services, stopping  # noqa: F401 - stopping: its signal

        # Rollout tasks carry time limits that follow each rollout's timeout (the backstop).
        register_options(services.RUN_ROLLOUT_TASK, services.rollout_task_options)
        # A job whose agent does not import is refused where it is created, as an enqueue is.
        register_target_check(services.RUN_ROLLOUT_TASK, services.agent_problem)
        # A worker restarted under its node name takes over its dead processes' rollouts.
        register_takeover("rollouts", lambda node, pid: len(
            services.celery_worker_take_over(name=node, pid=pid)))
        # A resumed job's reclaim leaves attempts whose Celery process runs on this machine.
        register_holder_alive(services.attempt_holder_alive)
        # The scaling signal counts the Celery rollouts (README "Scaling").
        register_backlog(Queue.ROLLOUTS.value, selectors.celery_rollout_backlog)
        # The trainer says why a step that needs GPUs waits from the live workers' devices.
        register_worker_devices(selectors.live_worker_devices)
        # The embedded default's in-process workers run our control work, re-send and goodbye.
        embedded.register_control(embedded.Control(
            sweep=lambda: {**services.control_sweep(), **services.control_reconcile()},
            resend_queued=lambda: services.rollouts_redispatch(resend_after_seconds=0),
            worker_stopped=lambda node, pid: services.celery_worker_stop(name=node, pid=pid),
        ))
