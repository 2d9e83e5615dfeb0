"""The fair share over HTTP (README "Scheduling"): a project's admin key sets its weight, cap
and a party's weight; any key reads the share and why its rollouts wait; the runner's dequeue
skips a project at its cap until one of its rollouts ends."""

from __future__ import annotations

from store import services
from store.services import RolloutSpec
from tests.api.conftest import Keys, http


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
