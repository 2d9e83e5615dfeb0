from django.core.management.base import BaseCommand

from core import control
from core.console import progress_stream
from runners import selectors
from runners.held_slots import held_slots
from runners.management.commands._progress import follow, project_named, summary
from store import selectors as store_selectors


class Command(BaseCommand):
    help = ("Watch a project's rollouts: counts by status, live workers per queue, and what is "
            "waiting and why, with a progress bar until every rollout is finished.")

    def add_arguments(self, parser):
        parser.add_argument("project", help="the project's name")
        parser.add_argument("--interval", type=float, default=2.0, help="seconds between updates")
        parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
        parser.add_argument("--timeout", type=float, default=None,
                            help="stop following after this many seconds")

    def handle(self, *args, project, interval, once, timeout, **options):
        project = project_named(project)
        for state in selectors.queue_states():
            workers = ", ".join(state.live_workers) or "-"
            line = f"queue {state.queue}: {workers}"
            if state.waiting_reason:
                line += f" (waiting: {state.waiting_reason})"
            if state.held_by_ended:
                line += (f" ({state.held_by_ended} slots held by attempts that already ended; "
                         f"RUNNERS_STOP_GRACE_SECONDS)")
            self.stdout.write(line)
            if state.load is not None:
                self.stdout.write(f"  load: {state.load.describe()}")
        share = store_selectors.share_state(project=project)  # README "Scheduling"
        self.stdout.write(share.describe())
        for party in share.parties:
            self.stdout.write(f"  party {party.key or '(project)'!s}: weight {party.weight:g}, "
                              f"usage {party.usage:.1f}, {party.live} claimed, "
                              f"{party.queued} queued")
        for line in control.waiting_lines(project.pk):  # other apps' (training steps)
            self.stdout.write(line)
        for slot in held_slots():
            self.stdout.write(f"  held: {slot.rollout_id}/{slot.attempt_id} "
                              f"({slot.attempt_status}) on {slot.worker_id} since "
                              f"{slot.since:%H:%M:%S}")
        if once:
            by_status = selectors.rollouts_by_status(project=project)
            self.stdout.write(summary(project, by_status))
            return
        # Current work only: the rollouts open now, not the project's whole history.
        open_ids = selectors.open_rollout_ids(project=project)
        if not open_ids:
            self.stdout.write(summary(project, selectors.rollouts_by_status(project=project)))
            return
        self.stdout.write(f"following the {len(open_ids)} rollouts open now")
        by_status = follow(project, open_ids, interval=interval, timeout=timeout,
                           out=progress_stream(self.stdout))
        self.stdout.write(summary(project, by_status))
