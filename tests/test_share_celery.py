"""The store's choice of what runs next (README "Scheduling") with real Celery workers on a
real broker and a runner's dequeue on Postgres: the fair order across projects and jobs,
priority jumping the queue, a project's cap on concurrent rollouts holding and releasing."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from runners import services as runner_services
from store import services
from store.models import Attempt, Rollout
from store.services import RolloutSpec
from tests.celery_fixtures import use_broker, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
SLEEPY = "tests.celery_agents:looping_agent"  # runs task["seconds"], then succeeds


def _enqueue(project, n, *, seconds=0.05, priority=0, party="", tag=""):
    specs = [RolloutSpec(input={"seconds": seconds, "tag": tag, "i": i}, priority=priority)
             for i in range(n)]
    return runner_services.rollouts_enqueue_for_celery(project=project, specs=specs,
                                                       agent=SLEEPY, party=party)


def _started(projects) -> list[Attempt]:
    return list(Attempt.objects.filter(rollout__project__in=projects)
                .select_related("rollout").order_by("start_time", "pk"))


def _done(projects, n) -> bool:
    return Rollout.objects.filter(project__in=projects, status="succeeded").count() == n


def test_a_celery_worker_serves_projects_by_their_weights(project, other_project, broker_url,
                                                         sending_to, celery_workers):
    """Project weight 2 enqueues first, weight 1 after: one slot, each message a ticket; the
    first 15 claims go 10:5 (give or take the one a tie decides), not 15:0 in send order."""
    services.share_set(project=project, weight=2)
    _enqueue(project, 20)
    _enqueue(other_project, 20)
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=1)
    wait_until(lambda: _done([project, other_project], 40), timeout=240)
    first = [a.rollout.project_id for a in _started([project, other_project])[:15]]
    assert 9 <= first.count(project.pk) <= 11, first


def test_a_priority_batch_starts_before_queued_lower_ones(project, other_project, broker_url,
                                                         sending_to, celery_workers):
    """A large priority-0 job saturates the one slot; a priority-10 batch of another project
    enqueued meanwhile runs as soon as the slot frees, before every lower one still queued."""
    _enqueue(project, 30, seconds=0.2)
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=1)
    wait_until(lambda: len(_started([project])) >= 2, timeout=120)
    high = _enqueue(other_project, 3, seconds=0.05, priority=10)
    wait_until(lambda: _done([project, other_project], 33), timeout=180)
    enqueued = max(r.enqueue_time for r in Rollout.objects.filter(pk__in=[h.pk for h in high]))
    attempts = _started([project, other_project])
    last_high = max(a.start_time for a in attempts if a.rollout.project_id == other_project.pk)
    later_low = [a for a in attempts
                 if a.rollout.project_id == project.pk and a.start_time > enqueued]
    assert later_low and all(a.start_time > last_high for a in later_low)


def test_a_projects_cap_holds_its_rollouts_back_and_releases_them(project, broker_url,
                                                                  sending_to, celery_workers):
    """Cap 1 with three slots: never two of its rollouts claimed at once (each attempt ends
    before the next one starts), and all run: the end of one sends the next one's message."""
    services.share_set(project=project, max_concurrent_rollouts=1)
    _enqueue(project, 5, seconds=0.3)
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=3)
    wait_until(lambda: _done([project], 5), timeout=120,
               message="a capped project's rollouts were not all released")
    attempts = _started([project])
    assert len(attempts) == 5
    for before, after in zip(attempts, attempts[1:], strict=False):
        assert before.end_time <= after.start_time, (before, after)


def test_a_dequeue_takes_a_projects_jobs_by_their_weights(project):
    """A runner's dequeue, within its project, across its jobs (weights 3:1): the first 8
    claims go 6:2; a job at priority 5 goes first whatever its usage."""
    services.share_set(project=project, party="job-a", party_weight=3)
    for party in ("job-a", "job-b"):
        services.rollout_enqueue_many(project=project, party=party, specs=[
            RolloutSpec(input={"party": party, "i": i}) for i in range(10)])
    taken = [r.input["party"]
             for _ in range(8) for r, _ in services.rollout_dequeue_many(project=project)]
    assert taken.count("job-a") == 6, taken
    services.rollout_enqueue_many(project=project, party="job-a", specs=[
        RolloutSpec(input={"party": "urgent", "i": 0}, priority=5)])
    first = services.rollout_dequeue_many(project=project, limit=2)
    assert first[0][0].input["party"] == "urgent"


def test_a_capped_project_is_skipped_by_the_dequeue_until_one_ends(project):
    services.share_set(project=project, max_concurrent_rollouts=2)
    services.rollout_enqueue_many(project=project, specs=[RolloutSpec(input=i)
                                                          for i in range(4)])
    claimed = services.rollout_dequeue_many(project=project, limit=4)
    assert len(claimed) == 2
    assert services.rollout_dequeue_many(project=project) == []
    rollout, attempt = claimed[0]
    services.attempt_finish(project=project, rollout_id=rollout.pk,
                            attempt_id=attempt.attempt_id, status="succeeded")
    assert len(services.rollout_dequeue_many(project=project, limit=4)) == 1


def test_share_set_sets_weights_and_the_cap_and_refuses_bad_input(project):
    out = io.StringIO()
    call_command("share_set", project=project.name, weight=2.0, cap="3", stdout=out)
    call_command("share_set", project=project.name, party="trainer/job/4", weight=0.5,
                 stdout=out)
    assert "weight 2, max concurrent rollouts 3" in out.getvalue()
    assert "party 'trainer/job/4': weight 0.5" in out.getvalue()
    project.refresh_from_db()
    assert (project.share_weight, project.max_concurrent_rollouts) == (2.0, 3)
    call_command("share_set", project=project.name, cap="none", stdout=out)
    project.refresh_from_db()
    assert project.max_concurrent_rollouts is None
    for bad in ({"weight": -1.0}, {"cap": "many"}, {"cap": "-2"}):
        with pytest.raises(CommandError):
            call_command("share_set", project=project.name, stdout=out, **bad)
    with pytest.raises(CommandError, match="no project"):
        call_command("share_set", project="nope", weight=1.0)


@pytest.mark.postgres
def test_the_migration_puts_queued_rollouts_into_their_projects_party(project):
    """Rollouts queued before fair share (no party) join the project's party "": the claim
    reaches them. Others are left as they were."""
    taken, waiting = services.rollout_enqueue_many(project=project, specs=[
        RolloutSpec(input=0, priority=1), RolloutSpec(input=1)])
    services.rollout_claim(project=project, rollout_id=taken.pk)
    executor = MigrationExecutor(connection)
    try:
        executor.migrate([("store", "0011_project_gpu_quota")])
    finally:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(executor.loader.graph.leaf_nodes())
    parties = dict(Rollout.objects.filter(project=project).values_list("pk", "party__key"))
    assert parties == {taken.pk: None, waiting.pk: ""}
    assert services.rollout_dequeue(project=project)[0].pk == waiting.pk


def test_a_rollout_whose_message_ran_a_shorter_one_is_owed_a_message_at_once(
        project, broker_url, sending_to, celery_workers):
    """The long rollout's message (ticket) runs the short one (higher priority); the short
    one's message has time limits too short for the long one, so the long one would wait for
    the re-send age (RUNNERS_REDISPATCH_SECONDS): it is owed a message now instead, and the
    next reconcile (here called by hand, with the 300 s age) sends it. The worker is busy
    with a first rollout while both are enqueued (after its start, which re-sends the oldest
    queued messages)."""
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=1)
    first = _enqueue(project, 1, seconds=2.0)[0]
    wait_until(lambda: Rollout.objects.get(pk=first.pk).status == "running", timeout=120)
    long = runner_services.rollouts_enqueue_for_celery(project=project, specs=[RolloutSpec(
        input={"seconds": 0.05}, config={"timeout_seconds": 600})], agent=SLEEPY)[0]
    short = runner_services.rollouts_enqueue_for_celery(project=project, specs=[RolloutSpec(
        input={"seconds": 0.05}, config={"timeout_seconds": 30}, priority=5)], agent=SLEEPY)[0]
    wait_until(lambda: Rollout.objects.get(pk=short.pk).status == "succeeded", timeout=120)

    def long_done() -> bool:
        runner_services.rollouts_redispatch(resend_after_seconds=300)
        return Rollout.objects.get(pk=long.pk).status == "succeeded"

    wait_until(long_done, timeout=60)
    assert Rollout.objects.get(pk=long.pk).dispatch_count == 2


def test_a_rollout_whose_message_ran_one_never_published_is_owed_a_message_at_once(
        project, broker_url, sending_to, celery_workers):
    """The first rollout's message was never published (the broker was unreachable for the
    sender: owed, for the next reconcile); the second's message (a ticket) runs the first,
    the older one. The second then has no message: it is owed one now, and the next
    reconcile (here called by hand, with the 300 s age) sends it. Before, its row said sent
    and it waited for the re-send age (tests/test_chaos.py: 9 rollouts, 300 s)."""
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=1)
    busy = _enqueue(project, 1, seconds=2.0)[0]
    wait_until(lambda: Rollout.objects.get(pk=busy.pk).status == "running", timeout=120)
    with use_broker("redis://127.0.0.1:18604/0"):  # nothing listens there
        unsent = _enqueue(project, 1)[0]
    assert Rollout.objects.get(pk=unsent.pk).dispatched_at is None
    second = _enqueue(project, 1)[0]
    wait_until(lambda: Rollout.objects.get(pk=unsent.pk).status == "succeeded", timeout=120)

    def second_done() -> bool:
        runner_services.rollouts_redispatch(resend_after_seconds=300)
        return Rollout.objects.get(pk=second.pk).status == "succeeded"

    wait_until(second_done, timeout=60)
