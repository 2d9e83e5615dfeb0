"""A self-contained tour of the store: enqueue, claim, spans, finish, sweep, statistics."""

import json
import time

from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from store import selectors, services, watchdog
from store.models import Project
from store.services import AttemptUpdate, RolloutSpec


class Command(BaseCommand):
    help = "Run a small store workload end to end and print statistics."

    def add_arguments(self, parser):
        parser.add_argument("--project", default="demo", help="project to use (default demo)")
        parser.add_argument("--rollouts", type=int, default=200, help="rollouts to run (200)")
        parser.add_argument("--batch", type=int, default=10, help="rollouts per batch (10)")

    def handle(self, *args, project, rollouts, batch, **options):
        if rollouts < 1 or batch < 1:
            raise CommandError("--rollouts and --batch must be >= 1")
        proj = Project.objects.filter(name=project).first()
        proj = proj or services.project_create(name=project)
        services.resources_add(project=proj, resources={"prompt": {
            "resource_type": "prompt_template", "template": "Q: {q}", "engine": "f-string",
        }})
        started = time.perf_counter()
        services.rollout_enqueue_many(project=proj, specs=[
            RolloutSpec(input={"q": i}, mode="train", config={"timeout_seconds": 60})
            for i in range(rollouts)
        ])
        with tqdm(total=rollouts, unit="rollout", desc="rollouts") as bar:
            while claimed := services.rollout_dequeue_many(
                project=proj, worker_id="demo", limit=batch
            ):
                spans = [_span(r, a) for r, a in claimed]
                services.spans_add(project=proj, spans=spans)
                services.attempt_update_many(project=proj, updates=[
                    AttemptUpdate(r.pk, a.attempt_id, status="succeeded") for r, a in claimed
                ])
                bar.update(len(claimed))
        elapsed = time.perf_counter() - started
        watchdog.sweep()
        stats = selectors.statistics(project=proj)
        self.stdout.write(json.dumps(stats, indent=2))
        self.stdout.write(f"{rollouts} rollouts in {elapsed:.2f}s ({rollouts / elapsed:.0f}/s)")


def _span(rollout, attempt) -> dict:
    return {
        "rollout_id": rollout.pk, "attempt_id": attempt.attempt_id, "sequence_id": 1,
        "trace_id": "0" * 32, "span_id": "0" * 15 + "1", "name": "agentlightning.annotation",
        "attributes": {"agentlightning.reward.0.name": "primary",
                       "agentlightning.reward.0.value": float(rollout.input["q"] % 2)},
    }
