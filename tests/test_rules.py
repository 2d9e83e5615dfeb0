"""Each state rule of store/rules.py, its SQL fragment against its Python function, over edge
inputs (None, 0, 1, 1e8, 1e12, negative, every status, retry lists, terminal states): the
answers must be equal (issue 23). Fragments the SQLite default runs (the watchdog's look-ahead
read) are held to it on SQLite too; the rest are Postgres statements' and run there. The ORM
forms (`.q`) are held to the Python function on real rows."""

from __future__ import annotations

import itertools
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.utils import timezone
from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

from store import rules, selectors
from store.models import Attempt, Project, Rollout, UsageEntry
from store.services import (
    RolloutSpec,
    _claim,
    _verdict,
    project_create,
    rollout_enqueue_many,
    spans,
)
from store.statemachine import AttemptStatus, RolloutConfig, RolloutStatus

NOW = timezone.now().replace(microsecond=654321)
NEAR_END = datetime(9999, 12, 31, 23, 59, 50, tzinfo=UTC)
SECONDS = [None, 0, -1, 1, 0.1, 2.5, 1e-6, 1e8, rules.MAX_LIMIT_SECONDS,
           rules.MAX_LIMIT_SECONDS + 1, 1e12]
TIMES = [None, NOW - timedelta(seconds=1), NOW - timedelta(microseconds=1), NOW,
         NOW + timedelta(microseconds=1), NOW + timedelta(seconds=1)]
HEARTBEATS = [None, NOW - timedelta(seconds=2), NOW - timedelta(seconds=1),
              NOW - timedelta(microseconds=999999), NOW - timedelta(seconds=0.5), NOW,
              NOW + timedelta(seconds=0.5), NOW + timedelta(hours=1)]
CONFIGS = [None, {}, {"max_attempts": 3}, {"retry_condition": ["failed"]},
           {"retry_condition": ["failed"], "max_attempts": 3},
           {"retry_condition": ["failed", "timeout", "unresponsive"], "max_attempts": 2},
           {"retry_condition": None, "max_attempts": 5}, {"retry_condition": [], "max_attempts": 2}]
METADATA = [None, {}, {"a": 1}, {"error": "old", "x": [1, {"y": None}]}, [1, 2], "text", 5]
ERRORS = ["boom", "", "ünï \"quoted\" 'single' \\ back"]
ATTEMPT_STATUSES = list(AttemptStatus.values)
ROLLOUT_STATUSES = list(RolloutStatus.values)


def _param(value):
    """A parameter as the database's own paths pass it."""
    if isinstance(value, datetime) and connection.vendor != "postgresql":
        return connection.ops.adapt_datetimefield_value(value)
    return value


def _check(rule, casts: dict[str, str], cases: list[tuple], python_args=None, sql_value=None,
           convert=None) -> int:
    """Every case answered the same by the rule's Python function and by `SELECT` of its
    fragment, each argument a placeholder with its cast (`casts`, in argument order)."""
    python_args = python_args or (lambda case: case)
    sql_value = sql_value or (lambda name, value: value)
    convert = convert or (lambda row: row[0])
    names = list(casts)
    tagged = rule.sql(*(f"<{name}>" for name in names))
    order = re.findall(r"<(\w+)>", tagged)
    fragment = re.sub(r"<(\w+)>", lambda m: casts[m.group(1)], tagged)
    wrong = []
    with connection.cursor() as cursor:
        for case in cases:
            values = dict(zip(names, case, strict=True))
            cursor.execute(f"SELECT {fragment}",
                           [_param(sql_value(name, values[name])) for name in order])
            answer, expected = convert(cursor.fetchone()), rule.python(*python_args(case))
            if answer != expected:
                wrong.append((case, expected, answer))
    assert not wrong, f"{len(wrong)} of {len(cases)} cases differ, e.g. {wrong[:5]}"
    return len(cases)


def _as_bool(row):
    return bool(row[0])


TS = "%s::timestamptz"


# --- Rules whose fragment also runs on SQLite (the watchdog's look-ahead read) -------------

@pytest.mark.django_db
@pytest.mark.parametrize("rule, statuses", [
    (rules.CLAIMABLE, ROLLOUT_STATUSES), (rules.QUEUE_EXPIRED, ROLLOUT_STATUSES),
    (rules.ATTEMPT_OVERDUE, ATTEMPT_STATUSES)], ids=lambda v: getattr(v, "name", ""))
def test_status_and_time_rules_agree(rule, statuses):
    cases = list(itertools.product(statuses, TIMES, [NOW]))
    cast = "%s::timestamptz" if connection.vendor == "postgresql" else "%s"
    n = _check(rule, {"status": "%s", "time": cast, "now": cast}, cases, convert=_as_bool)
    print(f"{rule.name}: {n} cases on {connection.vendor}")


@pytest.mark.django_db
@pytest.mark.parametrize("rule", [rules.CLAIMABLE, rules.QUEUE_EXPIRED], ids=lambda r: r.name)
def test_queue_rules_orm_form_agrees(rule):
    """The ORM's filter (`.q`, the claim's SQLite path and the watchdog's sweep) on real rows."""
    project = project_create(name=f"q-{rule.name}")
    cases = list(itertools.product(ROLLOUT_STATUSES, TIMES))
    rows = rollout_enqueue_many(project=project,
                                specs=[RolloutSpec(input=i) for i in range(len(cases))])
    for row, (status, deadline) in zip(rows, cases, strict=True):
        Rollout.objects.filter(pk=row.pk).update(status=status, queue_deadline=deadline)
    chosen = set(Rollout.objects.filter(rule.q(NOW), project=project).values_list("pk",
                                                                                  flat=True))
    expected = {row.pk for row, case in zip(rows, cases, strict=True)
                if rule.python(*case, NOW)}
    assert chosen == expected


@pytest.mark.django_db
def test_attempt_overdue_orm_form_agrees():
    project = project_create(name="q-overdue")
    cases = list(itertools.product(ATTEMPT_STATUSES, TIMES))
    rollout = rollout_enqueue_many(project=project, specs=[RolloutSpec(input=0)])[0]
    Attempt.objects.bulk_create([
        Attempt(rollout=rollout, attempt_id=rules.new_attempt_id(), sequence_id=i + 1,
                status=status, start_time=NOW, deadline=deadline)
        for i, (status, deadline) in enumerate(cases)])
    chosen = set(Attempt.objects.filter(rules.ATTEMPT_OVERDUE.q(NOW), rollout=rollout)
                 .values_list("sequence_id", flat=True))
    expected = {i + 1 for i, case in enumerate(cases) if rules.ATTEMPT_OVERDUE.python(*case, NOW)}
    assert chosen == expected


USED = [None, 0, 0.5, 100, 3599.9, 3600, 3612]
CAPS = [None, 0, 1, 100, 3600]


@pytest.mark.django_db
def test_gpu_quota_agrees():
    """The fragment (no cap, a cap of 0, at, under and past it, nothing used), and the ORM's
    form on real projects and ledger rows (store.selectors.gpu_quotas)."""
    cases = list(itertools.product(USED, CAPS))
    cast = "%s::float8" if connection.vendor == "postgresql" else "%s"
    _check(rules.GPU_QUOTA, {"used": cast, "cap": cast}, cases, convert=_as_bool)
    projects = {}
    for i, (used, cap) in enumerate(cases):
        project = project_create(name=f"quota-{i}")
        Project.objects.filter(pk=project.pk).update(gpu_seconds_per_day=cap)
        for part in ([] if not used else [used / 2, used / 2]):
            UsageEntry.objects.create(project=project, kind="step", gpu_seconds=part,
                                      created_at=NOW - timedelta(hours=1))
        projects[project.pk] = (used, cap)
    reached = selectors.gpu_quotas(project_ids=list(projects), reached_only=True)
    assert set(reached) == {pk for pk, case in projects.items() if rules.GPU_QUOTA.python(*case)}


# --- Postgres statements' rules --------------------------------------------------------------

@pytest.mark.postgres
@pytest.mark.django_db
def test_limit_bounds_agree():
    _check(rules.LIMIT, {"s": "%s::float8"}, [(s,) for s in SECONDS], convert=_as_bool)


@pytest.mark.postgres
@pytest.mark.django_db
@pytest.mark.parametrize("start", [NOW, NEAR_END], ids=["now", "near-year-10000"])
def test_deadline_agrees(start):
    """The claim's, the export's and the services' deadline: every limit (out of bounds
    included), a heartbeat or none, the first-report window, and a start near the last
    instant Python can hold."""
    heartbeats = [None, start - timedelta(seconds=0.5)]
    cases = list(itertools.product([start], heartbeats, SECONDS, SECONDS, [None, 0, 300, 1e12]))
    casts = {"start": TS, "heartbeat": TS, "timeout": "%s::float8",
             "unresponsive": "%s::float8", "first_report": "%s::float8"}
    n = _check(rules.DEADLINE, casts, cases)
    print(f"deadline: {n} cases from {start}")


@pytest.mark.postgres
@pytest.mark.django_db
@pytest.mark.parametrize("rule", [rules.RETRY, rules.ROLLOUT_FOR_ATTEMPT], ids=lambda r: r.name)
def test_retry_rules_agree(rule):
    """Every attempt status, sequence ids around max_attempts, retry lists and their absence
    (the Python side reads the config as RolloutConfig.parse does, the SQL side as jsonb)."""
    cases = list(itertools.product(ATTEMPT_STATUSES, [0, 1, 2, 3, 5, 10**8], CONFIGS))

    def python_args(case):
        status, seq, raw = case
        config = RolloutConfig.parse(raw)
        return status, seq, config.retry_condition, config.max_attempts

    def sql_value(name, value):
        return json.dumps(value) if name == "config" and value is not None else value

    convert = _as_bool if rule is rules.RETRY else None
    _check(rule, {"status": "%s::varchar", "seq": "%s::int", "config": "%s::jsonb"}, cases,
           python_args, sql_value, convert)


@pytest.mark.postgres
@pytest.mark.django_db
@pytest.mark.parametrize("rule", [rules.FOLLOWS, rules.HEARTBEAT_MOVES_ROLLOUT],
                         ids=lambda r: r.name)
def test_rollout_moves_agree(rule):
    """Every rollout status (terminal ones included), the attempt the latest or not, none."""
    cases = list(itertools.product(ROLLOUT_STATUSES, [None, 1, 2], [1]))
    _check(rule, {"status": "%s::varchar", "latest": "%s::bigint", "attempt": "%s::bigint"},
           cases, convert=_as_bool)


@pytest.mark.postgres
@pytest.mark.django_db
def test_heartbeat_due_agrees():
    """Every attempt status; a heartbeat never, long ago, at the interval's edge, within
    it, now, and ahead of our clock (a runner's)."""
    cases = list(itertools.product(ATTEMPT_STATUSES, HEARTBEATS, [NOW]))
    _check(rules.HEARTBEAT_DUE, {"status": "%s::varchar", "last": TS, "now": TS}, cases,
           convert=_as_bool)


@pytest.mark.postgres
@pytest.mark.django_db
@pytest.mark.parametrize("rule", [rules.REVIVES, rules.WORKER_FOR_ATTEMPT],
                         ids=lambda r: r.name)
def test_attempt_status_rules_agree(rule):
    convert = _as_bool if rule is rules.REVIVES else None
    _check(rule, {"status": "%s::varchar"}, [(s,) for s in ATTEMPT_STATUSES], convert=convert)


@pytest.mark.postgres
@pytest.mark.django_db
def test_worker_after_claim_agrees():
    _check(rules.WORKER_AFTER_CLAIM, {"claimed": "%s::boolean"}, [(True,), (False,)])


@pytest.mark.postgres
@pytest.mark.django_db
def test_error_merge_agrees():
    """Metadata none, empty, with an error already, not an object; errors with quotes."""
    cases = list(itertools.product(METADATA, ERRORS))
    fragment = rules.ERROR_MERGE.sql("%(m)s::jsonb", "%(e)s")
    answers = []
    with connection.cursor() as cursor:
        for metadata, error in cases:
            cursor.execute(f"SELECT ({fragment})::text",
                           {"m": None if metadata is None else json.dumps(metadata), "e": error})
            answers.append(json.loads(cursor.fetchone()[0]))
    wrong = [(case, rules.ERROR_MERGE.python(*case), answer)
             for case, answer in zip(cases, answers, strict=True)
             if rules.ERROR_MERGE.python(*case) != answer]
    assert not wrong


@pytest.mark.postgres
@pytest.mark.django_db
def test_attempt_id_agrees():
    """The claim's statement picks the ids Python made (one generator), in AGL's format."""
    ids = [rules.new_attempt_id() for _ in range(3)]
    assert all(re.fullmatch(r"at-[0-9a-f]{8}", i) for i in ids)
    cases = [(ids, index) for index in (-1, 0, 1, 2, 3, 4)]
    _check(rules.ATTEMPT_ID, {"ids": "%s", "index": "%s::int"}, cases)


@pytest.mark.postgres
@pytest.mark.django_db
def test_group_count_agrees():
    """Counts up and down (a reopened member), below, at and past the total, an empty group,
    a completion time kept or not."""
    earlier = NOW - timedelta(minutes=1)
    cases = list(itertools.product([0, 1, 2, 3], [0, 1, 3], [None, earlier], [-1, 1, 2],
                                   [NOW]))
    casts = {"finished": "%s::int", "total": "%s::int", "completed_at": TS, "delta": "%s::int",
             "now": TS}
    _check(rules.GROUP_COUNT, casts, cases, convert=tuple)


@pytest.mark.postgres
@pytest.mark.django_db
def test_decayed_usage_agrees():
    """No usage yet, fresh, one and many half-lives old, past the underflow bound, a time
    ahead of ours; half-lives short and long. Postgres's and Python's powers may differ in
    the last bits: equal to 12 digits."""
    cases = list(itertools.product(
        [0.0, 1.0, 3.5, 1e6],
        [None, NOW, NOW - timedelta(seconds=1), NOW - timedelta(seconds=600),
         NOW - timedelta(days=400), NOW + timedelta(seconds=5)],
        [NOW], [0.001, 1.0, 600.0]))
    fragment = rules.DECAYED.sql("%(u)s::float8", "%(at)s::timestamptz", "%(now)s::timestamptz",
                                 "%(hl)s::float8")
    with connection.cursor() as cursor:
        for case in cases:
            cursor.execute(f"SELECT {fragment}", dict(zip(["u", "at", "now", "hl"], case,
                                                          strict=True)))
            assert cursor.fetchone()[0] == pytest.approx(rules.DECAYED.python(*case),
                                                         rel=1e-12, abs=1e-300), case
    assert rules.DECAYED.python(4.0, NOW - timedelta(seconds=600), NOW, 600.0) == 2.0


@pytest.mark.postgres
@pytest.mark.django_db
def test_under_cap_agrees():
    cases = list(itertools.product([0, 1, 2, 5], [None, 0, 1, 2, 5]))
    _check(rules.UNDER_CAP, {"live": "%s::int8", "cap": "%s::int4"}, cases, convert=_as_bool)


@pytest.mark.postgres
@pytest.mark.django_db
def test_fits_agrees():
    """A rollout's timeout (absent, null, 0, within, past) against a ticket's bound."""
    configs = [{}, {"timeout_seconds": None}, {"timeout_seconds": 0}, {"timeout_seconds": 1},
               {"timeout_seconds": 2.5}, {"timeout_seconds": 1e9}]
    cases = list(itertools.product(configs, [None, 0.0, 1.0, 2.5, 3.2e9]))
    _check(rules.FITS, {"config": "%s::jsonb", "max": "%s::float8"}, cases,
           python_args=lambda case: (case[0].get("timeout_seconds"), case[1]),
           sql_value=lambda name, value: json.dumps(value) if name == "config" else value,
           convert=_as_bool)


@pytest.mark.django_db
def test_fits_orm_form_agrees():
    """The ORM's filter (`.q`, the claim's SQLite path) on real rows, the same cases."""
    project = project_create(name="q-fits")
    configs = [{}, {"timeout_seconds": None}, {"timeout_seconds": 0}, {"timeout_seconds": 1},
               {"timeout_seconds": 2.5}, {"timeout_seconds": 1e9}]
    rows = rollout_enqueue_many(project=project,
                                specs=[RolloutSpec(input=i) for i in range(len(configs))])
    for row, config in zip(rows, configs, strict=True):
        Rollout.objects.filter(pk=row.pk).update(config=config)
    for bound in [None, 0.0, 1.0, 2.5, 3.2e9]:
        chosen = set(Rollout.objects.filter(rules.FITS.q(bound), project=project)
                     .values_list("pk", flat=True))
        expected = {row.pk for row, config in zip(rows, configs, strict=True)
                    if rules.FITS.python(config.get("timeout_seconds"), bound)}
        assert chosen == expected, bound


@pytest.mark.postgres
@pytest.mark.django_db
def test_share_order_agrees():
    """Rows of mixed priorities, usages, weights and ages sort the same by the fragment (an
    ORDER BY) and by the Python key."""
    values = itertools.product([0, 3], [0.0, 2.0, 5.0], [1.0, 2.0], [0.0, 1.5], [1.0, 3.0],
                               [NOW, NOW - timedelta(seconds=1)])
    rows = [(i, *v) for i, v in enumerate(values)]
    order = rules.SHARE_ORDER.sql("p", "pu", "pw", "u", "w", "t")
    placeholders = ", ".join(["(%s::int, %s::int, %s::float8, %s::float8, %s::float8, "
                              "%s::float8, %s::timestamptz)"] * len(rows))
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT i FROM (VALUES {placeholders}) v(i, p, pu, pw, u, w, t) "
                       f"ORDER BY {order}, i", [x for row in rows for x in row])
        answer = [row[0] for row in cursor.fetchall()]
    expected = [row[0] for row in sorted(rows, key=lambda r: (rules.SHARE_ORDER.python(*r[1:]),
                                                              r[0]))]
    assert answer == expected


def test_usage_half_life_is_checked(settings):
    settings.SCHEDULER_USAGE_HALF_LIFE_SECONDS = 0
    with pytest.raises(ImproperlyConfigured, match="SCHEDULER_USAGE_HALF_LIFE_SECONDS"):
        rules.usage_half_life()


def test_lock_order_is_one_order():
    rules.locks_in_order("attempt", "rollout", "worker", "group")
    rules.locks_in_order("attempt", "group")
    with pytest.raises(AssertionError):
        rules.locks_in_order("rollout", "group", "worker")


def test_every_rule_has_its_test():
    tested = {"limit", "deadline", "claimable", "queue_expired", "attempt_overdue", "retry",
              "rollout_for_attempt", "follows", "heartbeat_due", "revives",
              "heartbeat_moves_rollout", "error_merge", "attempt_id", "worker_for_attempt",
              "worker_after_claim", "group_count", "span_counter", "span_base",
              "span_ids_durable", "gpu_quota", "decayed",
              "under_cap", "share_order", "fits"}
    assert {rule.name for rule in rules.ALL} == tested


# Fragments of the rules as they were written before store/rules.py held them: none may be
# written again outside it.
OLD_FRAGMENTS = [
    "make_interval(", "md5(random", "'queuing'", "'requeuing'", "'preparing'", "'idle'",
    "'busy'", "jsonb_build_object('error'", "retry_condition'", "max_attempts'",
    "queue_deadline IS NULL OR", "finished >= total", "g.finished + ", "secrets.token_hex(4)",
    "GREATEST(", "LEAST(", "'running'", "'succeeded'", "'cancelled'", "'timeout'",
    "'unresponsive'", "'unknown'",
]


def test_rules_are_written_only_in_rules_py():
    root = Path(__file__).resolve().parent.parent / "store"
    found = []
    for path in root.rglob("*.py"):
        if path.name == "rules.py" or "migrations" in path.parts:
            continue
        text = path.read_text()
        found += [f"{path.relative_to(root)}: {f}" for f in OLD_FRAGMENTS if f in text]
    assert not found


@pytest.mark.parametrize("seconds, allowed", [
    (0, True), (0.0, True), (1, True), (300, True), (rules.MAX_LIMIT_SECONDS, True),
    (rules.MAX_LIMIT_SECONDS + 1, False), (1e12, False)])
def test_the_first_report_window_is_a_limit_within_the_bounds(settings, seconds, allowed):
    """A window beyond the bound would silently be no window (the deadline ignores it):
    refused loudly instead."""
    settings.STORE_FIRST_REPORT_SECONDS = seconds
    if allowed:
        assert rules.first_report_seconds() == seconds
    else:
        with pytest.raises(ImproperlyConfigured, match="STORE_FIRST_REPORT_SECONDS"):
            rules.first_report_seconds()


@pytest.mark.postgres
@pytest.mark.django_db
def test_span_counter_agrees():
    """A counter at 1 and far on; explicit ids below, at and past it, negative, none; none
    to many spans without an id."""
    cases = list(itertools.product([1, 5, 10**6], [None, -3, 0, 1, 5, 6, 10**6 + 7],
                                   [0, 1, 3]))
    _check(rules.SPAN_COUNTER, {"counter": "%s::int4", "next": "%s::int4",
                                "missing": "%s::int4"}, cases)


_STARTS = [None, datetime(2026, 12, 1, 8, 0, tzinfo=UTC), datetime(2026, 12, 5, 9, 30, tzinfo=UTC)]


@pytest.mark.postgres
@pytest.mark.django_db
def test_span_base_agrees():
    """A counter below, at and past the reserve; the rollout's epoch and the current one
    each unknown (None), the same, another."""
    cases = list(itertools.product([1, 64, 65, 500], [65, 129], _STARTS, _STARTS))
    _check(rules.SPAN_BASE, {"counter": "%s::int4", "reserved": "%s::int4",
                             "epoch": "%s::timestamptz", "current": "%s::timestamptz"}, cases)


@pytest.mark.postgres
@pytest.mark.django_db
def test_span_ids_durable_agrees():
    """Reservations ending below, at and past the reserve, in the same epoch, another, or
    with either unknown."""
    cases = list(itertools.product([1, 63, 64, 65, 200], [1, 2, 7], [65, 129], _STARTS,
                                   _STARTS))
    _check(rules.SPAN_IDS_DURABLE, {"base": "%s::int4", "count": "%s::int4",
                                    "reserved": "%s::int4", "epoch": "%s::timestamptz",
                                    "current": "%s::timestamptz"}, cases, convert=_as_bool)


def test_span_base_skips_what_a_crash_may_have_lost():
    """The same epoch, or none yet: the counter itself; another (or the current one unknown):
    at least the reserve; and a reservation that stays within the reserve in the same epoch may commit
    asynchronously, one that reaches past it (or in another epoch) may not."""
    now, before = _STARTS[2], _STARTS[1]
    assert rules.SPAN_BASE.python(10, 65, now, now) == 10
    assert rules.SPAN_BASE.python(10, 65, before, now) == 65
    assert rules.SPAN_BASE.python(10, 65, None, now) == 10  # none handed out asynchronously
    assert rules.SPAN_BASE.python(300, 65, before, now) == 300
    assert rules.SPAN_BASE.python(10, 65, now, None) == 65  # the epoch now unknown: skip
    assert rules.SPAN_BASE.python(10, 65, None, None) == 10
    assert not rules.SPAN_IDS_DURABLE.python(64, 1, 65, now, now)
    assert rules.SPAN_IDS_DURABLE.python(65, 1, 65, now, now)
    assert rules.SPAN_IDS_DURABLE.python(10, 1, 65, before, now)


@pytest.mark.postgres
@pytest.mark.django_db
def test_hot_statements_stay_within_psycopgs_parse_cache():
    """The rules' fragments make the statements longer; past psycopg's 4 KB the statement's
    parsing is not cached and every claim pays it again (the claim grew to 4.2 KB: about
    30 us of client CPU more per rollout claimed, under load)."""
    flags = list(itertools.product([False, True], repeat=3))
    # (named, worker, key checked, ticket[, uncapped only]): a ticket (a Celery message) is
    # never key-checked
    claims = [f for f in itertools.product([False, True], repeat=4) if not (f[2] and f[3])]
    # and a project's unnamed claim that takes nothing of a capped project (the lean dequeue's)
    claims += [(*f, True) for f in claims if not f[0] and not f[3]]
    lengths = {f"claim{f}": len(_claim._claim_statement(*f)[0]) for f in claims}
    lengths |= {f"verdict{f}": len(_verdict._sql(*f)) for f in flags}
    lengths |= {f"export{k}": len(spans._common_sql(1, k)) for k in (False, True)}
    print(lengths)
    assert max(lengths.values()) <= MAX_CACHED_STATEMENT_LENGTH, lengths
