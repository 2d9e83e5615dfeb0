from django.apps import AppConfig

from lightning_site.control import register_reconciler
from store import hooks


class TrainerConfig(AppConfig):
    name = "trainer"
    verbose_name = "Lightning trainer"

    def ready(self) -> None:
        # Django's documented place for wiring that needs models: they load only after the
        # app registry is ready, which is why this import is here and not at the top.
        from trainer import reactions, services

        # The store's one explicit hook: finished rollouts may complete a training step.
        hooks.on_rollouts_finished(reactions.rollouts_finished)
        # The control sweep re-sends training steps left by a dead worker (and steps whose
        # finished-rollouts hook was missed, or whose deadline passed).
        register_reconciler("training_steps", services.steps_redispatch)
