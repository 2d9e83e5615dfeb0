from django.core.management.base import BaseCommand, CommandError

from store import services
from store.errors import StoreError
from store.management.arguments import project_named


def _cap(value: str) -> int | None:
    if value.lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise CommandError(f"--max-concurrent-rollouts: {value!r} is not an integer or 'none'"
                           ) from None


class Command(BaseCommand):
    help = ("Set a project's fair-share weight and cap on concurrent rollouts, or the weight "
            "of one of its parties (a training job's is trainer/job/<id>). README "
            "\"Scheduling\". Prints what is set.")

    def add_arguments(self, parser):
        parser.add_argument("--project", required=True, help="the project's name")
        parser.add_argument("--weight", type=float,
                            help="the project's weight (with --party: the party's)")
        parser.add_argument("--party", help="a party key of the project ('' = its own)")
        parser.add_argument("--max-concurrent-rollouts", dest="cap",
                            help="cap on its claimed, unfinished rollouts; 'none' lifts it")

    def handle(self, *args, project, weight, party, cap, **options):
        row = project_named(project)
        try:
            share = services.share_set(
                project=row, weight=None if party is not None else weight, party=party,
                party_weight=weight if party is not None else None,
                max_concurrent_rollouts=services.UNCHANGED if cap is None else _cap(cap))
        except StoreError as exc:
            raise CommandError(str(exc)) from None
        cap_text = share.max_concurrent_rollouts
        cap_text = "none" if cap_text is None else cap_text
        self.stdout.write(f"project {row.name}: weight {share.project_weight:g}, "
                          f"max concurrent rollouts {cap_text}")
        if share.party is not None:
            self.stdout.write(f"party {share.party!r}: weight {share.party_weight:g}")
