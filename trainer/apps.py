from django.apps import AppConfig

from store import hooks


class TrainerConfig(AppConfig):
    name = "trainer"
    verbose_name = "Lightning trainer"

    def ready(self) -> None:
        # Django's documented place for wiring that needs models: they load only after the
        # app registry is ready, which is why this import is here and not at the top.
        from trainer import reactions

        hooks.on_rollouts_finished(reactions.rollouts_finished)
