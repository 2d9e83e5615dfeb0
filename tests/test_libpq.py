"""`fetch_one_prepared` through libpq itself (store/services/_libpq.py): in autocommit it
runs a statement as one `PQexecPrepared`, and must give what a psycopg cursor gives (values,
errors as Django's), leave no transaction open, and leave statements inside Django's
`atomic` to a cursor (psycopg opens the transaction there)."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.db import (
    DataError,
    IntegrityError,
    NotSupportedError,
    OperationalError,
    connection,
    transaction,
)

from store.services import _libpq
from store.services._rows import fetch_one_prepared
from tests.conftest import terminate_backend

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

_VALUES = ("SELECT %s::int4, %s::int8, %s::text, %s::text, %s::float8, %s::timestamptz, "
           "%s::text[], %s::jsonb, %s::bool, 'a literal 100%%'")


def _params() -> list:
    return [7, 2**40, "héllo", None, 1.5, dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
            ["x", "y,z"], '{"a": [1, 2.5, null]}', True]


@pytest.fixture
def table():
    """A table of its own (`id int PRIMARY KEY`), dropped after the test."""
    name = f"libpq_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE {name} (id int PRIMARY KEY)")
    yield name
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {name}")


def _count(table: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {table}")
        return cursor.fetchone()[0]


def _prepared_names() -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM pg_prepared_statements")
        return {name for (name,) in cursor.fetchall()}


def test_values_are_a_cursors_and_the_statement_is_prepared_once():
    connection.ensure_connection()
    assert _libpq.usable(connection.connection)
    with connection.cursor() as cursor:
        cursor.execute(_VALUES, _params())
        expected = cursor.fetchone()
    assert fetch_one_prepared(_VALUES, _params()) == expected
    assert fetch_one_prepared(_VALUES, _params()) == expected
    assert len({n for n in _prepared_names() if n.startswith("_lx")}) == 1
    # Another magnitude of an integer dumps as another type: prepared under its own name.
    assert fetch_one_prepared("SELECT %s::int8 + 1", [5])[0] == 6
    assert fetch_one_prepared("SELECT %s::int8 + 1", [2**40])[0] == 2**40 + 1
    assert fetch_one_prepared("SELECT 1 WHERE false", []) is None


def test_errors_are_djangos_and_leave_no_transaction_open(table):
    insert = f"INSERT INTO {table} VALUES (%s) RETURNING id"
    assert fetch_one_prepared(insert, [1]) == (1,)
    with pytest.raises(IntegrityError):
        fetch_one_prepared(insert, [1])
    with pytest.raises(DataError):
        fetch_one_prepared("SELECT %s::int4 / 0", [1])
    assert connection.connection.info.transaction_status == 0  # idle: nothing open
    assert fetch_one_prepared(insert, [2]) == (2,)  # the connection still serves
    assert _count(table) == 2  # each committed on its own


def test_inside_atomic_the_statement_is_the_transactions(table):
    with pytest.raises(RuntimeError), transaction.atomic():
        assert not _libpq.usable(connection.connection)
        assert fetch_one_prepared(f"INSERT INTO {table} VALUES (%s) RETURNING id",
                                  [1]) == (1,)
        raise RuntimeError("roll back")
    assert _count(table) == 0  # rolled back with the transaction


def test_without_prepared_statements_nothing_is_prepared(monkeypatch):
    connection.ensure_connection()
    monkeypatch.setitem(connection.settings_dict, "PREPARED_STATEMENTS", False)
    before = _prepared_names()
    assert fetch_one_prepared("SELECT %s::int4 * 3", [4]) == (12,)
    assert _prepared_names() == before


def test_a_statement_whose_plan_the_server_refuses_is_prepared_again(table):
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {table} VALUES (1)")
    select = f"SELECT * FROM {table} WHERE id = %s"
    assert fetch_one_prepared(select, [1]) == (1,)
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} ADD COLUMN b int DEFAULT 5")
    with pytest.raises(NotSupportedError):  # cached plan must not change result type
        fetch_one_prepared(select, [1])
    assert fetch_one_prepared(select, [1]) == (1, 5)


def test_statements_deallocated_under_it_are_prepared_again():
    """psycopg sends DEALLOCATE ALL after a rollback, a DROP or an ALTER of its own: the
    names of this path are gone too, and its next run prepares them again."""
    assert fetch_one_prepared("SELECT %s::int4 + 1", [1]) == (2,)
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    assert not {n for n in _prepared_names() if n.startswith("_lx")}
    assert fetch_one_prepared("SELECT %s::int4 + 1", [2]) == (3,)
    assert fetch_one_prepared("SELECT %s::int4 + 1", [3]) == (4,)
    assert len({n for n in _prepared_names() if n.startswith("_lx")}) == 1


def test_at_most_max_prepared_statements_are_kept(monkeypatch):
    monkeypatch.setattr(_libpq, "MAX_PREPARED", 3)
    for n in range(5):
        assert fetch_one_prepared(f"SELECT %s::int4 + {n}", [1]) == (1 + n,)
    kept = {n for n in _prepared_names() if n.startswith("_lx")}
    assert len(kept) == 3
    # The oldest went first; the others still run under their names.
    assert fetch_one_prepared("SELECT %s::int4 + 4", [1]) == (5,)
    assert {n for n in _prepared_names() if n.startswith("_lx")} == kept


def test_the_oldest_statement_gone_already_is_no_error(monkeypatch):
    """At the bound, the least recently run statement is deallocated; one a DEALLOCATE ALL
    took already is no error: all were taken, and the new one is prepared."""
    monkeypatch.setattr(_libpq, "MAX_PREPARED", 2)
    assert fetch_one_prepared("SELECT %s::int4 + 10", [1]) == (11,)
    assert fetch_one_prepared("SELECT %s::int4 + 20", [1]) == (21,)
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    assert fetch_one_prepared("SELECT %s::int4 + 30", [1]) == (31,)
    assert fetch_one_prepared("SELECT %s::int4 + 10", [1]) == (11,)
    assert len({n for n in _prepared_names() if n.startswith("_lx")}) == 2


def test_notices_reach_the_connections_handlers():
    """libpq calls psycopg's notice receiver inside the call (the GIL released around it)."""
    connection.ensure_connection()
    seen: list[str] = []
    connection.connection.add_notice_handler(lambda notice: seen.append(notice.message_primary))
    with connection.cursor() as cursor:
        cursor.execute("CREATE FUNCTION pg_temp.noisy() RETURNS int AS $$ BEGIN "
                       "RAISE NOTICE 'hello'; RETURN 1; END $$ LANGUAGE plpgsql")
    assert [fetch_one_prepared("SELECT pg_temp.noisy() + %s::int4", [n])
            for n in range(2)] == [(1,), (2,)]
    assert seen == ["hello", "hello"]


def test_a_lost_connection_is_an_operational_error_as_a_cursors():
    """Retries and Django's connection handling know an OperationalError for a connection
    to drop and open again (libpq's own error result has no SQLSTATE)."""
    assert fetch_one_prepared("SELECT %s::int4", [1]) == (1,)
    terminate_backend()
    with pytest.raises(OperationalError):
        fetch_one_prepared("SELECT %s::int4", [2])
    connection.close_if_unusable_or_obsolete()
    assert fetch_one_prepared("SELECT %s::int4", [3]) == (3,)
