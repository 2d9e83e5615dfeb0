"""The fair share over HTTP (README "Scheduling"): a project's admin key sets its weight, cap
and a party's weight; any key reads the share and why its rollouts wait; the runner's dequeue
skips a project at its cap until one of its rollouts ends."""

from __future__ import annotations

import pytest

from store import services
from store.models import Attempt
from store.services import RolloutSpec
from tests.api.conftest import Keys, http
from tests.api.test_api_remote_runner import RunnerProcess


def test_the_admin_sets_the_share_and_a_capped_dequeue_waits_visibly(api_server, keys: Keys,
                                                                     runner):
    with http(api_server, keys.admin) as admin:
        answer = admin.post("/share", json={"weight": 2, "max_concurrent_rollouts": 1,
                                            "party": "trainer/job/7", "party_weight": 3})
        assert answer.status_code == 200, answer.text
        assert answer.json()["weight"] == 2 and answer.json()["max_concurrent_rollouts"] == 1
        assert admin.post("/share", json={"weight": 0}).status_code == 422
    assert runner.post("/share", json={"weight": 5}).status_code == 403
    services.rollout_enqueue_many(project=keys.project, specs=[RolloutSpec(input=i)
                                                               for i in range(3)])
    first = runner.post("/queues/rollouts/dequeue", json={"worker_id": "w", "limit": 3}).json()
    assert len(first) == 1
    assert runner.post("/queues/rollouts/dequeue", json={"worker_id": "w"}).json() == []
    share = runner.get("/share").json()
    assert share["live"] == 1 and share["queued"] == 2
    assert share["waiting_reason"].startswith("cap: 1 of 1")
    assert {p["key"]: p["weight"] for p in share["parties"]}["trainer/job/7"] == 3
    done = runner.post(f"/rollouts/{first[0]['rollout_id']}/attempts/"
                       f"{first[0]['attempt']['attempt_id']}/finish", json={"status": "succeeded"})
    assert done.status_code < 300, done.text
    assert len(runner.post("/queues/rollouts/dequeue", json={"worker_id": "w"}).json()) == 1


@pytest.mark.slow
def test_a_remote_runner_takes_its_projects_jobs_by_their_weights(api_server, keys: Keys,
                                                                 tmp_path):
    """`manage.py runner` (one slot, a real process over HTTP): jobs weighted 3:1, the second
    enqueued first; of the first 8 rollouts it runs, 6 are the first job's."""
    services.share_set(project=keys.project, party="job-a", party_weight=3)
    for party in ("job-b", "job-a"):
        services.rollout_enqueue_many(project=keys.project, party=party, specs=[
            RolloutSpec(input={"i": i}) for i in range(10)])
    runner = RunnerProcess(api_server.url, keys.runner, "tests.celery_agents:ok_agent",
                           tmp_path, "--concurrency", "1", "--max-rollouts", "8")
    try:
        assert runner.proc.wait(timeout=120) == 0, runner.output()
    finally:
        runner.stop()
    first = (Attempt.objects.filter(rollout__project=keys.project)
             .order_by("start_time", "pk").values_list("rollout__party__key", flat=True))
    assert list(first).count("job-a") == 6, list(first)
