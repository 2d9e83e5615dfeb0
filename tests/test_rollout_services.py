from datetime import timedelta

import pytest
from django.utils import timezone

from store import selectors, services
from store.errors import InvalidInput, NotFound
from store.models import Rollout, Worker
from store.services import RolloutSpec
from tests.conftest import claim, enqueue


def test_enqueue_creates_queued_rollout_with_agl_ids(project):
    rollout = services.rollout_enqueue(
        project=project, spec=RolloutSpec(input={"q": 1}, mode="train", metadata={"k": "v"})
    )
    rollout.refresh_from_db()
    assert rollout.id.startswith("ro-") and len(rollout.id) == 15
    assert rollout.status == "queuing"
    assert rollout.input == {"q": 1} and rollout.mode == "train"
    assert rollout.config["max_attempts"] == 1
    assert rollout.latest_attempt is None and rollout.end_time is None


def test_enqueue_refuses_bad_mode(project):
    with pytest.raises(InvalidInput) as err:
        services.rollout_enqueue(project=project, spec=RolloutSpec(input=1, mode="play"))
    assert err.value.field == "mode"
    assert Rollout.objects.count() == 0


def test_unknown_resources_id_is_stored_as_given_and_pinned_once_it_exists(project):
    rollout = services.rollout_enqueue(project=project, spec=RolloutSpec(input=1,
                                                                          resources_id="rs-later"))
    assert (rollout.resources_id, rollout.resources_version) == ("rs-later", None)
    _, attempt = services.rollout_start(project=project, spec=RolloutSpec(input=2,
                                                                           resources_id="rs-x"))
    assert attempt.rollout.resources_id == "rs-x"
    services.resources_update(project=project, resources_id="rs-later",
                              resources={"p": {"resource_type": "x"}})
    moved = services.rollout_update(project=project, rollout_id=rollout.pk,
                                    resources_id="rs-later")
    assert (moved.resources_id, moved.resources_version) == ("rs-later", 1)
    moved = services.rollout_update(project=project, rollout_id=rollout.pk,
                                    resources_id="rs-nowhere")
    assert (moved.resources_id, moved.resources_version) == ("rs-nowhere", None)


def test_enqueue_many_is_all_or_nothing(project):
    specs = [RolloutSpec(input=1), RolloutSpec(input=2, config={"max_attempts": 0})]
    with pytest.raises(InvalidInput):
        services.rollout_enqueue_many(project=project, specs=specs)
    assert Rollout.objects.count() == 0


def test_retried_enqueue_with_same_idempotency_key_returns_first_rollout(project):
    first = services.rollout_enqueue(project=project, spec=RolloutSpec(input=1, idempotency_key="k"))
    again = services.rollout_enqueue(project=project, spec=RolloutSpec(input=2, idempotency_key="k"))
    assert again.pk == first.pk
    assert Rollout.objects.count() == 1
    batch = services.rollout_enqueue_many(project=project, specs=[
        RolloutSpec(input=3, idempotency_key="k"), RolloutSpec(input=4, idempotency_key="n"),
        RolloutSpec(input=5, idempotency_key="n"),
    ])
    assert batch[0].pk == first.pk and batch[1].pk == batch[2].pk
    assert Rollout.objects.count() == 2


def test_idempotency_keys_are_per_project(project, other_project):
    a = services.rollout_enqueue(project=project, spec=RolloutSpec(input=1, idempotency_key="k"))
    b = services.rollout_enqueue(project=other_project, spec=RolloutSpec(idempotency_key="k"))
    assert a.pk != b.pk


def test_dequeue_is_fifo_and_creates_attempt_one(project):
    rollouts = enqueue(project, 3)
    got = [claim(project) for _ in range(3)]
    assert [r.pk for r, _ in got] == [r.pk for r in rollouts]
    rollout, attempt = got[0]
    rollout.refresh_from_db()
    assert rollout.status == "preparing" and rollout.latest_attempt_id == attempt.pk
    assert attempt.sequence_id == 1 and attempt.status == "preparing"
    assert attempt.attempt_id.startswith("at-") and len(attempt.attempt_id) == 11
    assert services.rollout_dequeue(project=project, worker_id="w1") is None


def test_dequeue_takes_higher_priority_first(project):
    low = enqueue(project, 2)
    high = services.rollout_enqueue(project=project, spec=RolloutSpec(input=9, priority=5))
    assert claim(project)[0].pk == high.pk
    assert claim(project)[0].pk == low[0].pk


def test_dequeue_many_respects_limit_and_project(project, other_project):
    enqueue(project, 5)
    enqueue(other_project, 5)
    claimed = services.rollout_dequeue_many(project=project, worker_id="w", limit=3)
    assert len(claimed) == 3
    assert {r.project_id for r, _ in claimed} == {project.pk}
    assert len(services.rollout_dequeue_many(project=project, limit=10)) == 2


def test_dequeue_marks_worker_busy_then_idle_on_empty_queue(project):
    enqueue(project, 1)
    rollout, attempt = claim(project, "w9")
    worker = Worker.objects.get(worker_id="w9")
    assert worker.status == "busy" and worker.current_rollout_id == rollout.pk
    assert worker.current_attempt_id == attempt.attempt_id and worker.last_dequeue_time
    assert services.rollout_dequeue(project=project, worker_id="w9") is None
    assert Worker.objects.get(worker_id="w9").status == "idle"


def test_dequeue_skips_rollouts_whose_queue_wait_expired(project):
    services.rollout_enqueue(project=project, spec=RolloutSpec(input=1, queue_timeout_seconds=5))
    Rollout.objects.update(queue_deadline=timezone.now() - timedelta(seconds=1))
    assert services.rollout_dequeue(project=project) is None


def test_start_rollout_skips_the_queue(project):
    rollout, attempt = services.rollout_start(
        project=project, spec=RolloutSpec(input="x"), worker_id="w"
    )
    rollout.refresh_from_db()
    assert rollout.status == "preparing" and attempt.sequence_id == 1
    assert services.rollout_dequeue(project=project) is None


def test_start_attempt_by_hand_ignores_max_attempts(project):
    enqueue(project, 1)
    rollout, first = claim(project)
    _, second = services.attempt_start(project=project, rollout_id=rollout.pk, worker_id="w2")
    rollout.refresh_from_db()
    assert second.sequence_id == 2 and rollout.latest_attempt_id == second.pk
    assert rollout.status == "preparing"


def test_start_attempt_by_hand_reopens_a_finished_rollout(project):
    enqueue(project, 1)
    rollout, first = claim(project)
    services.attempt_update(project=project, rollout_id=rollout.pk,
                            attempt_id=first.attempt_id, status="succeeded")
    _, second = services.attempt_start(project=project, rollout_id=rollout.pk)
    rollout.refresh_from_db()
    assert second.sequence_id == 2 and rollout.latest_attempt_id == second.pk
    assert rollout.status == "preparing" and rollout.end_time is None


def test_update_rollout_cancel_sets_end_time_and_removes_from_queue(project):
    rollout = enqueue(project, 1)[0]
    updated = services.rollout_update(project=project, rollout_id=rollout.pk, status="cancelled")
    assert updated.status == "cancelled" and updated.end_time is not None
    assert services.rollout_dequeue(project=project) is None


def test_algorithm_may_requeue_a_failed_rollout(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    services.attempt_update(project=project, rollout_id=rollout.pk,
                            attempt_id=attempt.attempt_id, status="failed")
    rollout.refresh_from_db()
    assert rollout.status == "failed"
    requeued = services.rollout_update(project=project, rollout_id=rollout.pk,
                                       status="requeuing")
    assert requeued.status == "requeuing" and requeued.end_time is None
    again, retry = services.rollout_dequeue(project=project)
    assert again.pk == rollout.pk and retry.sequence_id == 2


def test_terminal_rollout_stays_terminal_against_a_late_runner_report(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    services.rollout_update(project=project, rollout_id=rollout.pk, status="cancelled")
    services.attempt_update(project=project, rollout_id=rollout.pk,
                            attempt_id=attempt.attempt_id, status="succeeded")
    rollout.refresh_from_db()
    assert rollout.status == "cancelled"


def test_update_rollout_fields_and_unknown_id(project):
    rollout = enqueue(project, 1)[0]
    updated = services.rollout_update(
        project=project, rollout_id=rollout.pk, input={"new": 1}, mode="val",
        metadata={"a": 1}, config={"max_attempts": 2, "retry_condition": ["failed"]},
    )
    updated.refresh_from_db()
    assert updated.input == {"new": 1} and updated.mode == "val" and updated.metadata == {"a": 1}
    assert updated.config["max_attempts"] == 2
    with pytest.raises(NotFound):
        services.rollout_update(project=project, rollout_id="ro-missing", status="cancelled")
    with pytest.raises(InvalidInput):
        services.rollout_update(project=project, rollout_id=rollout.pk, status="exploded")


def test_other_projects_rollouts_are_not_found(project, other_project):
    rollout = enqueue(project, 1)[0]
    with pytest.raises(NotFound):
        selectors.rollout_get(project=other_project, rollout_id=rollout.pk)
    with pytest.raises(NotFound):
        services.rollout_update(project=other_project, rollout_id=rollout.pk, status="cancelled")


def test_enqueue_pins_latest_resources_version(project):
    v1 = services.resources_add(project=project, resources={"p": {"resource_type": "x"}})
    services.resources_update(project=project, resources_id=v1.resource_set.resources_id,
                              resources={"p": {"resource_type": "y"}})
    rollout = enqueue(project, 1)[0]
    assert rollout.resources_id == v1.resource_set.resources_id and rollout.resources_version == 2


def test_claim_named_rollout_once(project):
    rollout = enqueue(project, 2)[1]
    got = services.rollout_claim(project=project, rollout_id=rollout.pk, worker_id="w")
    assert got is not None and got[0].pk == rollout.pk and got[1].sequence_id == 1
    assert services.rollout_claim(project=project, rollout_id=rollout.pk, worker_id="w") is None
    assert services.rollout_claim(project=project, rollout_id="ro-missing") is None


@pytest.mark.parametrize("config,expected", [
    ({}, 300),  # STORE_FIRST_REPORT_SECONDS: the claim's window until a first report
    ({"timeout_seconds": 30}, 30),
    ({"unresponsive_seconds": 10}, 10),
    ({"timeout_seconds": 30, "unresponsive_seconds": 10}, 10),
    ({"timeout_seconds": 5, "unresponsive_seconds": 10}, 5),
])
def test_claimed_attempt_deadline_is_the_earlier_limit(project, config, expected):
    enqueue(project, 1, config=config)
    _, attempt = claim(project)
    attempt.refresh_from_db()
    if expected is None:
        assert attempt.deadline is None
    else:
        assert (attempt.deadline - attempt.start_time).total_seconds() == pytest.approx(expected)


def test_claim_returns_rows_as_stored(project):
    enqueue(project, 3, metadata={"m": 1})
    claimed = services.rollout_dequeue_many(project=project, worker_id="w", limit=3)
    for rollout, attempt in claimed:
        stored = Rollout.objects.get(pk=rollout.pk)
        assert stored.latest_attempt_id == attempt.pk == rollout.latest_attempt_id
        assert stored.input == rollout.input and rollout.metadata == {"m": 1}
        assert stored.status == rollout.status == "preparing"
        assert attempt.attempt_id == stored.latest_attempt.attempt_id


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_dequeue_outside_a_transaction_is_one_statement_on_postgres(project):
    """The claim is one statement: without BEGIN and COMMIT around it (two round trips)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    enqueue(project, 2)
    with CaptureQueriesContext(connection) as captured:
        claimed = services.rollout_dequeue_many(project=project, worker_id="w1", limit=1)
    assert len(claimed) == 1 and len(captured.captured_queries) == 1
    with CaptureQueriesContext(connection) as captured:  # nothing found, worker kept busy
        assert services.rollout_dequeue_many(project=project, worker_id="w2", limit=5,
                                             idle_if_none=False) != []
        assert services.rollout_dequeue_many(project=project, worker_id="w3", limit=1,
                                             idle_if_none=False) == []
    assert len(captured.captured_queries) == 2
    assert not Worker.objects.filter(worker_id="w3").exists()
    assert Worker.objects.get(worker_id="w1").status == "busy"


@pytest.mark.parametrize("config,field", [
    ({"timeout_seconds": 2.5e11}, "config.timeout_seconds"),
    ({"unresponsive_seconds": 1e12}, "config.unresponsive_seconds"),
])
def test_a_limit_no_deadline_can_hold_is_refused_at_enqueue(project, config, field):
    # A trainer's or CLI's config reaches the services without REST's serializer: the bound is
    # the store's rule. Before it, the claim committed a deadline Postgres accepts and psycopg
    # cannot read back, and the rollout stayed `preparing`.
    with pytest.raises(InvalidInput) as refused:
        services.rollout_enqueue(project=project, spec=RolloutSpec(input=1, config=config))
    assert refused.value.field == field
    with pytest.raises(InvalidInput, match="queue_timeout_seconds"):
        services.rollout_enqueue(project=project, spec=RolloutSpec(input=1, queue_timeout_seconds=1e12))
    assert not Rollout.objects.filter(project=project).exists()


def test_the_longest_limit_is_claimed_with_its_deadline(project, settings):
    settings.STORE_FIRST_REPORT_SECONDS = 0  # else the claim's window comes first
    services.rollout_enqueue(project=project, spec=RolloutSpec(
        input=1, config={"timeout_seconds": 3.2e9, "unresponsive_seconds": 3.2e9}))
    rollout, attempt = claim(project)
    assert attempt.deadline is not None and attempt.deadline > timezone.now() + timedelta(days=36000)


def test_a_tickets_claim_takes_only_a_rollout_whose_timeout_fits_its_bound(project):
    """rules.FITS in the claim (the statement on Postgres, the ORM path's query elsewhere):
    no timeout, a JSON null one, or one past the bound do not fit; without a bound all do."""
    rollouts = services.rollout_enqueue_many(project=project, specs=[
        RolloutSpec(input=0), RolloutSpec(input=1, config={"timeout_seconds": 900}),
        RolloutSpec(input=2, config={"timeout_seconds": 300}), RolloutSpec(input=3)])
    Rollout.objects.filter(pk=rollouts[3].pk).update(config={"timeout_seconds": None})
    services.rollout_dispatch_set(project=project, rollout_ids=[r.pk for r in rollouts],
                                  dispatch="celery", target="x.agent")
    ticket = {"dispatch": "celery", "worker_id": "w"}
    rollout, _ = services.rollout_claim_next(max_timeout=600, **ticket)
    assert rollout.pk == rollouts[2].pk
    assert services.rollout_claim_next(max_timeout=600, **ticket) is None
    assert services.rollout_claim_next(max_timeout=None, **ticket)[0].pk == rollouts[0].pk
