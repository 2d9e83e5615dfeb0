from django.apps import AppConfig

from core.control import register_reconciler, register_takeover, register_waiting
from core.queues import Queue
from core.scaling import register_backlog
from store import hooks


class TrainerConfig(AppConfig):
    name = "trainer"
    verbose_name = "Lightning trainer"

    def ready(self) -> None:
        # Django's documented place for wiring that needs models: they load only after the
        # app registry is ready, which is why this import is here and not at the top.
        from trainer import reactions, selectors, services
        from trainer.models import GROUP_OWNER

        # A step's rollout group finished: the store wrote a completion row; its nudge makes
        # the finishing process take it at once, the control sweep takes what a nudge missed.
        hooks.on_groups_completed(GROUP_OWNER, reactions.groups_completed)
        register_reconciler("training_groups", reactions.groups_completed)
        # An asynchronous job's step may train once enough groups finished (trainer/pool.py).
        # Hurry-only: the control sweep checks rolling steps anyway, and the one-statement
        # verdict (Postgres) must stay open to every project's rollouts. Grouped-only: it acts
        # on rollouts of a group alone, so that verdict reads no other rollout for it.
        hooks.on_rollouts_finished(reactions.rollouts_finished, hurry_only=True,
                                   grouped_only=True)
        # The control sweep re-sends training steps left by a dead worker (and steps whose
        # completion was not acted on, or whose deadline passed).
        register_reconciler("training_steps", services.steps_redispatch)
        # A training worker restarted under its node name takes back its dead processes' steps
        # at once instead of after their lease.
        register_takeover("training_steps", services.steps_take_over)
        # The scaling signal of the training queue counts its steps (README "Scaling").
        register_backlog(Queue.TRAINING.value, selectors.training_backlog)
        # queue_watch (runners) shows steps no live training worker can take, with the reason.
        register_waiting("training_steps", selectors.waiting_lines)
