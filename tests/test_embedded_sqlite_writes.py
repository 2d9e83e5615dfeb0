"""The embedded default's SQLite engine (core/sqlite_engine): the threads of one process that
write the file queue for it (no "database is locked"), transactions stay whole, nested atomic
blocks stay savepoints, reads need no turn, and another process is still kept apart.

Each case runs a script in a fresh process on the embedded default's settings (no
DATABASE_URL: core.env.sqlite_database, as `./lightning` users get it), with the busy timeout
cut from 30 s to 1 s so that a writer left waiting shows within the test.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest

from tests.celery_fixtures import ROOT

pytestmark = pytest.mark.slow

SETUP = """
import json, os, sys, threading
import django
django.setup()
from django.conf import settings
settings.DATABASES["default"]["OPTIONS"]["timeout"] = 1
from django.db import OperationalError, connection, connections, transaction
with connection.cursor() as cursor:
    cursor.execute("CREATE TABLE probe (thread INTEGER, n INTEGER, note TEXT)")
    cursor.execute("CREATE TABLE tally (thread INTEGER PRIMARY KEY, done INTEGER)")
connections.close_all()
"""

# THREADS threads, each ROUNDS rounds of: a transaction (a read, an insert, a nested atomic
# block that commits and one that rolls back), then a write outside any transaction.
WRITERS = SETUP + """
import time
THREADS, ROUNDS, HOLD = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
errors = []

def writer(t):
    try:
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO tally VALUES (%s, 0)", [t])
        for n in range(ROUNDS):
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SELECT count(*) FROM probe WHERE thread = %s AND note = 'outer'", [t])
                    assert cursor.fetchone()[0] == n
                    cursor.execute("INSERT INTO probe VALUES (%s, %s, 'outer')", [t, n])
                time.sleep(HOLD)  # work done while the transaction holds the file
                with transaction.atomic(), connection.cursor() as cursor:
                    cursor.execute("INSERT INTO probe VALUES (%s, %s, 'kept')", [t, n])
                try:
                    with transaction.atomic(), connection.cursor() as cursor:
                        cursor.execute("INSERT INTO probe VALUES (%s, %s, 'undone')", [t, n])
                        raise KeyError
                except KeyError:
                    pass
            with connection.cursor() as cursor:
                cursor.execute("UPDATE tally SET done = done + 1 WHERE thread = %s", [t])
    except Exception as error:  # noqa: BLE001 - reported to the test
        errors.append(repr(error))
    finally:
        connections.close_all()

threads = [threading.Thread(target=writer, args=(t,)) for t in range(THREADS)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps(errors))
"""

# A read outside a transaction runs while another thread's write transaction holds the turn.
READER = SETUP + """
with connection.cursor() as cursor:
    cursor.execute("INSERT INTO probe VALUES (0, 0, 'committed')")
read = []

def reader():
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT note FROM probe")
            read.extend(row[0] for row in cursor.fetchall())
    finally:
        connections.close_all()

with transaction.atomic(), connection.cursor() as cursor:
    cursor.execute("INSERT INTO probe VALUES (1, 0, 'uncommitted')")
    thread = threading.Thread(target=reader)
    thread.start()
    thread.join(timeout=30)
    read.append("read while held" if not thread.is_alive() else "reader still waiting")
print(json.dumps(read))
"""

# A transaction run in raw SQL (SAVEPOINT ... RELEASE outside any atomic block) holds the turn
# until it ends, then another thread writes.
RAW_TRANSACTION = SETUP + """
with connection.cursor() as cursor:
    cursor.execute("SAVEPOINT raw")
    cursor.execute("INSERT INTO probe VALUES (0, 0, 'raw')")
    cursor.execute("RELEASE raw")
done = []

def writer():
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("INSERT INTO probe VALUES (1, 0, 'after')")
        done.append("written")
    except OperationalError as error:
        done.append(str(error))
    finally:
        connections.close_all()

thread = threading.Thread(target=writer)
thread.start()
thread.join()
print(json.dumps(done))
"""

# Another process holds the file's write lock; a thread here writes once it is let go.
OTHER_PROCESS = SETUP + """
import sqlite3, time
other = sqlite3.connect(settings.DATABASES["default"]["NAME"], isolation_level=None)
other.execute("BEGIN IMMEDIATE")
other.execute("INSERT INTO probe VALUES (-1, 0, 'other process')")
seen = []

def writer():
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("INSERT INTO probe VALUES (0, 0, 'this process')")
        seen.append("written")
    except OperationalError as error:
        seen.append(str(error))
    finally:
        connections.close_all()

first = threading.Thread(target=writer)
first.start()
first.join()
second = threading.Thread(target=writer)
second.start()
time.sleep(0.3)
other.execute("COMMIT")
second.join()
print(json.dumps(seen))
"""

# One episode through the executor and the in-process gateway, as the embedded default's
# rollout threads run it: a ticket's claim, then the agent (spans and a reward), then its end.
# Prints the write turns each part took, the claim's statements, and what was stored.
EPISODE = """
import json, os, threading
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from django.db import connection
from django.test.utils import CaptureQueriesContext
from core.sqlite_engine import base
from runners import executor
from runners.local_gateway import LocalGateway
from store import services
from store.models import Attempt, Span

turns = []
take = base.WriteTurn.take
def counted(self):
    taken = take(self)
    turns.append(taken)
    return taken
base.WriteTurn.take = counted

project = services.project_create(name="episode")
rollouts = services.rollout_enqueue_many(
    project=project, specs=[services.RolloutSpec(input={"i": i}, config={"timeout_seconds": 300})
                            for i in (2, 3)],
    party="trainer/job/1")
services.rollout_dispatch_set(project=project, rollout_ids=[r.pk for r in rollouts],
                              dispatch="celery", target="tests.celery_agents.ok_agent")
seen = {}
for rollout in rollouts:  # the first warms the statement caches; the second is counted
    turns.clear()
    with CaptureQueriesContext(connection) as claim_sql:
        gateway, claim = LocalGateway.claim_next(dispatch="celery", max_timeout=600,
                                                 worker_id="w")
    sql = [q["sql"].split()[0] for q in claim_sql.captured_queries]
    seen["claim"] = [sum(turns), sql.index("COMMIT") - sql.index("BEGIN") + 1]
    turns.clear()
    outcome = executor.execute(gateway=gateway, claim=claim, agent="tests.celery_agents:ok_agent",
                               worker_id="w")
    seen["run"] = sum(turns)
attempt = Attempt.objects.get(attempt_id=claim.attempt_id)
seen["stored"] = [outcome.status, attempt.status, Span.objects.filter(attempt=attempt).count()]
print(json.dumps(seen))
"""


def run(tmp_path, script: str, *args: str) -> list:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(LIGHTNING_DATA_DIR=str(tmp_path), PYTHONPATH=str(ROOT), LOG_LEVEL="WARNING",
               DJANGO_SETTINGS_MODULE="lightning_site.settings")
    result = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def rows(tmp_path, sql: str) -> list:
    with sqlite3.connect(tmp_path / "lightning.sqlite3") as db:
        return db.execute(sql).fetchall()


def test_threads_of_one_process_writing_the_embedded_file_queue_without_locked_errors(
        tmp_path):
    threads, rounds = 64, 20
    assert run(tmp_path, WRITERS, str(threads), str(rounds), "0.002") == []
    assert rows(tmp_path, "SELECT note, count(*) FROM probe GROUP BY note ORDER BY note") == [
        ("kept", threads * rounds), ("outer", threads * rounds)]
    assert rows(tmp_path, "SELECT count(*), min(done), max(done) FROM tally") == [
        (threads, rounds, rounds)]


def test_a_read_outside_a_transaction_needs_no_turn(tmp_path):
    assert run(tmp_path, READER) == ["committed", "read while held"]


def test_a_transaction_in_raw_sql_gives_the_turn_back_when_it_ends(tmp_path):
    assert run(tmp_path, RAW_TRANSACTION) == ["written"]
    assert rows(tmp_path, "SELECT note FROM probe ORDER BY thread") == [("raw",), ("after",)]


def test_another_process_holding_the_file_still_keeps_this_process_writers_out(tmp_path):
    # The first writer waits out its 1 s busy timeout (the other process never lets go of the
    # file while it waits); the second is let in when the other process commits.
    seen = run(tmp_path, OTHER_PROCESS)
    assert seen[0].startswith("database is locked") and seen[1] == "written"
    assert rows(tmp_path, "SELECT thread, note FROM probe ORDER BY thread") == [
        (-1, "other process"), (0, "this process")]


def test_an_episode_takes_two_write_turns_its_last_spans_travel_with_its_verdict(tmp_path):
    """Per episode the embedded file's writers take turns twice: the claim, and the attempt's
    end (its last spans and its verdict in one write transaction, store.services.
    attempt_finish); the claim's transaction is BEGIN, the parties, the first queued rollout of
    each, the attempt's insert, the rollout's update, the party's usage, the worker, COMMIT."""
    seen = run(tmp_path, EPISODE)
    assert seen["stored"] == ["succeeded", "succeeded", 4]
    assert seen["run"] == 1
    assert seen["claim"] == [1, 8]
