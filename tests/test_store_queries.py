import json

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from store import selectors, services, wakeups
from store.errors import BadQuery, InvalidInput, NotFound
from store.models import Span
from store.services import RolloutSpec
from tests.conftest import claim, enqueue
from tests.test_span_services import span


def test_query_rollouts_filters_sorts_and_paginates(project, other_project):
    rollouts = enqueue(project, 5)
    enqueue(other_project, 3)
    services.rollout_update(project=project, rollout_id=rollouts[0].pk, status="cancelled")
    page = selectors.rollout_query(project=project)
    assert page.total == 5 and [r.pk for r in page.items] == [r.pk for r in rollouts]
    page = selectors.rollout_query(project=project, status_in=["cancelled"])
    assert [r.pk for r in page.items] == [rollouts[0].pk]
    page = selectors.rollout_query(project=project, limit=2, offset=1, sort_by="start_time",
                                   sort_order="desc")
    assert page.total == 5 and [r.pk for r in page.items] == [rollouts[3].pk, rollouts[2].pk]
    page = selectors.rollout_query(project=project, rollout_id_in=[rollouts[1].pk],
                                   status_in=["cancelled"], filter_logic="or")
    assert {r.pk for r in page.items} == {rollouts[0].pk, rollouts[1].pk}
    page = selectors.rollout_query(project=project, rollout_id_contains=rollouts[2].pk[3:9])
    assert rollouts[2].pk in [r.pk for r in page.items]


@pytest.mark.parametrize("kwargs", [{"sort_order": "up"}, {"filter_logic": "xor"}])
def test_query_rollouts_refuses_bad_parameters(project, kwargs):
    with pytest.raises(InvalidInput):
        selectors.rollout_query(project=project, **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    ({"sort_by": "bogus"}, "Invalid sort_by: bogus, allowed fields are: rollout_id, input, "
                           "start_time, end_time, mode, resources_id, status, config, metadata"),
    ({"offset": -1}, "Offset must be greater than or equal to 0"),
    ({"limit": 0}, "Limit must be greater than 0 or -1 for no limit"),
])
def test_query_rollouts_refuses_bad_paging_with_agls_messages(project, kwargs, message):
    with pytest.raises(BadQuery) as err:
        selectors.rollout_query(project=project, **kwargs)
    assert str(err.value) == message


def test_none_sorts_first_ascending_and_last_descending_except_times(project):
    rollouts = enqueue(project, 3)
    services.rollout_update(project=project, rollout_id=rollouts[1].pk, mode="val")
    services.rollout_update(project=project, rollout_id=rollouts[2].pk, status="cancelled")
    ids = [r.pk for r in rollouts]

    def order(**kw):
        return [r.pk for r in selectors.rollout_query(project=project, **kw).items]

    assert order(sort_by="mode")[-1] == ids[1]  # None (as "") before "val"
    assert order(sort_by="mode", sort_order="desc")[0] == ids[1]
    # *_time: None counts as infinity, as in AGL's store.
    assert order(sort_by="end_time")[0] == ids[2]
    assert order(sort_by="end_time", sort_order="desc")[-1] == ids[2]
    assert order(sort_by="metadata", limit=1)  # any field of the object sorts


def test_query_attempts_and_latest(project):
    enqueue(project, 1)
    rollout, first = claim(project)
    _, second = services.attempt_start(project=project, rollout_id=rollout.pk)
    page = selectors.attempt_query(project=project, rollout_id=rollout.pk)
    assert [a.sequence_id for a in page.items] == [1, 2]
    assert selectors.attempt_latest(project=project, rollout_id=rollout.pk).pk == second.pk
    assert selectors.attempt_get(project=project, rollout_id=rollout.pk,
                                 attempt_id=first.attempt_id).pk == first.pk
    # AGL: an unknown rollout has no attempts, an empty page rather than an error.
    assert selectors.attempt_query(project=project, rollout_id="ro-nope").total == 0


def test_latest_attempt_of_unclaimed_rollout_is_none(project):
    rollout = enqueue(project, 1)[0]
    assert selectors.attempt_latest(project=project, rollout_id=rollout.pk) is None


def test_workers_heartbeat_query_and_get(project, other_project):
    services.worker_update(project=project, worker_id="w-a", heartbeat_stats={"cpu": 1})
    services.worker_update(project=project, worker_id="w-b")
    services.worker_update(project=other_project, worker_id="w-a")
    worker = selectors.worker_get(project=project, worker_id="w-a")
    assert worker.heartbeat_stats == {"cpu": 1} and worker.last_heartbeat_time
    assert selectors.worker_query(project=project).total == 2
    assert [w.worker_id for w in selectors.worker_query(
        project=project, worker_id_contains="b").items] == ["w-b"]
    with pytest.raises(NotFound):
        selectors.worker_get(project=project, worker_id="w-zzz")
    with pytest.raises(InvalidInput):
        services.worker_update(project=project, worker_id="")


def test_wait_for_rollouts_returns_finished_ones_in_order(project):
    rollouts = enqueue(project, 3)
    for r in rollouts[:2]:
        services.rollout_update(project=project, rollout_id=r.pk, status="cancelled")
    done = selectors.rollouts_wait(project=project, rollout_ids=[r.pk for r in rollouts],
                                   timeout=0)
    assert [r.pk for r in done] == [rollouts[0].pk, rollouts[1].pk]


def test_wait_for_rollouts_waits_up_to_its_timeout(project, monkeypatch):
    """Asserted on what the wait did, not on the clock: it slept (never answered at its first
    look) for what was left of its 0.3 s, less at each look, until nothing was left."""
    rollout = enqueue(project, 1)[0]
    slept: list[float] = []
    real_sleep = wakeups.Waiter.sleep

    def sleep(self, remaining: float) -> None:
        slept.append(remaining)
        real_sleep(self, remaining)

    monkeypatch.setattr(wakeups.Waiter, "sleep", sleep)
    assert selectors.rollouts_wait(project=project, rollout_ids=[rollout.pk], timeout=0.3) == []
    assert slept and all(0 < left <= 0.3 for left in slept)
    assert slept == sorted(slept, reverse=True)


def test_statistics_count_the_project_only(project, other_project):
    enqueue(project, 2)
    enqueue(other_project, 5)
    claim(project)
    stats = selectors.statistics(project=project)
    assert stats["total_rollouts"] == 2 and stats["total_attempts"] == 1
    assert stats["rollouts_by_status"] == {"queuing": 1, "preparing": 1}


def _spans(project, n):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    services.spans_add(project=project, spans=[span(rollout, attempt, i) for i in range(1, n + 1)])


def test_statistics_count_spans_up_to_a_limit_and_say_so(project, monkeypatch):
    monkeypatch.setattr(selectors, "STATISTICS_SPAN_LIMIT", 3, raising=False)
    _spans(project, 2)
    stats = selectors.statistics(project=project)
    assert (stats["total_spans"], stats["total_spans_capped"]) == (2, False)
    _spans(project, 5)
    stats = selectors.statistics(project=project)
    assert (stats["total_spans"], stats["total_spans_capped"]) == (3, True)


@pytest.mark.postgres
def test_statistics_read_at_most_the_limit_of_spans(project, monkeypatch):
    """Bounded cost, as Postgres counts it: the plan's span scans return at most limit + 1
    rows however many spans the project has (before: every span, on each call)."""
    monkeypatch.setattr(selectors, "STATISTICS_SPAN_LIMIT", 3, raising=False)
    _spans(project, 20)
    with CaptureQueriesContext(connection) as queries:
        selectors.statistics(project=project)
    table = Span._meta.db_table
    [sql] = [q["sql"] for q in queries if f'FROM "{table}"' in q["sql"]]
    # With 20 spans the planner may hash the whole table whatever the limit; a project with
    # millions of spans gets the index plan, which this asks for (the test's tables are tiny).
    with transaction.atomic(), connection.cursor() as cursor:
        for switch in ("enable_hashjoin", "enable_mergejoin", "enable_seqscan"):
            cursor.execute(f"SET LOCAL {switch} = off")
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan

    def span_rows(node: dict) -> int:
        own = (node["Actual Rows"] * node["Actual Loops"]
               if node.get("Relation Name") == table else 0)
        return own + sum(span_rows(child) for child in node.get("Plans", []))

    assert 0 < span_rows(plan[0]["Plan"]) <= 4


def test_api_keys_are_hashed_shown_once_and_checked(project):
    key, raw = services.api_key_create(project=project, role="runner")
    assert raw not in key.hashed_key and key.prefix == raw[:12]
    assert services.api_key_authenticate(raw=raw).pk == key.pk
    assert services.api_key_authenticate(raw=raw[:-1] + ("x" if raw[-1] != "x" else "y")) is None
    assert services.api_key_authenticate(raw="") is None
    key.revoked_at = key.created_at
    key.save()
    assert services.api_key_authenticate(raw=raw) is None
    with pytest.raises(InvalidInput):
        services.api_key_create(project=project, role="god")


def test_project_names_are_unique(project):
    with pytest.raises(InvalidInput):
        services.project_create(name="proj")


def test_enqueue_priority_must_be_int(project):
    with pytest.raises(InvalidInput):
        services.rollout_enqueue(project=project, spec=RolloutSpec(priority="high"))


def test_a_zero_limit_is_an_empty_page_of_attempts(project):
    """AGL's store suite (test_query_attempts_zero_limit_returns_no_items); other queries
    keep AGL's server's 400 (above)."""
    enqueue(project, 1)
    rollout, _ = claim(project)
    page = selectors.attempt_query(project=project, rollout_id=rollout.pk, limit=0)
    assert (page.items, page.total) == ([], 1)


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_one_statement_path_binds_many_parameters_in_order_and_keeps_literal_percents():
    """fetch_one_prepared converts `%s` to `$n` itself (psycopg's RawCursor runs it): past
    psycopg's own cache limits (50 parameters), `%%` a literal `%`, anything else refused."""
    from store.services._rows import _native, fetch_one_prepared

    values = list(range(60))
    row = fetch_one_prepared("SELECT " + ", ".join(["%s::int"] * 60) + ", '100%%'", values)
    assert list(row[:60]) == values and row[60] == "100%"
    with pytest.raises(ValueError):
        _native("SELECT %(name)s")
