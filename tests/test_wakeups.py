"""Waiting requests are woken by Postgres NOTIFY from other connections' commits.

The fallback re-check interval is raised to far beyond each wait's timeout, so a wait that
returns early can only have been woken by a notification."""

import threading
import time

import pytest
from django.db import connection, transaction

from store import selectors, services, wakeups
from store.services.longpoll import rollout_dequeue_wait
from tests.conftest import claim, enqueue

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def notifications_only(monkeypatch):
    monkeypatch.setattr(wakeups, "CHECK_EVERY_SECONDS", 120.0)
    listener = wakeups._get_listener()
    assert listener.listening.wait(10), "the listener did not connect"


@pytest.fixture
def wakes(monkeypatch) -> list[bool]:
    """What each sleep of a waiting request ended by: True for a notification, False for its
    timeout (the event the tests assert on, not the time it took)."""
    ended: list[bool] = []
    wait = wakeups._Listener.wait

    def recorded(self, *args, **kwargs):
        ended.append(wait(self, *args, **kwargs))
        return ended[-1]

    monkeypatch.setattr(wakeups._Listener, "wait", recorded)
    return ended


def later(seconds: float, action) -> threading.Thread:
    """Run `action` on its own connection after `seconds` (as another process would)."""
    def run() -> None:
        try:
            time.sleep(seconds)
            action()
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_wait_for_rollouts_wakes_when_another_connection_finishes_them(project, wakes):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    finisher = later(0.3, lambda: services.attempt_update(
        project=project, rollout_id=rollout.pk, attempt_id=attempt.attempt_id,
        status="succeeded"))
    done = selectors.rollouts_wait(project=project, rollout_ids=[rollout.pk], timeout=30)
    finisher.join()
    assert [r.pk for r in done] == [rollout.pk] and done[0].status == "succeeded"
    assert wakes and wakes[-1] is True  # woken by the notification, not timed out


def test_long_poll_dequeue_wakes_when_another_connection_enqueues(project, wakes):
    producer = later(0.3, lambda: enqueue(project, 1))
    claimed = rollout_dequeue_wait(project=project, worker_id="w", wait_seconds=20)
    producer.join()
    assert len(claimed) == 1
    assert wakes and wakes[-1] is True  # woken by the notification, not timed out


def test_a_rolled_back_announcement_wakes_nobody(project):
    listener = wakeups._get_listener()
    token = listener.token(wakeups.QUEUED, project.pk)
    with pytest.raises(RuntimeError), transaction.atomic():
        wakeups.announce(wakeups.QUEUED, project.pk)
        raise RuntimeError("rolled back")
    with transaction.atomic():
        wakeups.announce(wakeups.QUEUED, project.pk)
    assert listener.wait(wakeups.QUEUED, project.pk, token, timeout=10)
    assert listener.token(wakeups.QUEUED, project.pk) == token + 1


def test_waiters_of_another_project_sleep_on(project, other_project):
    listener = wakeups._get_listener()
    mine = listener.token(wakeups.FINISHED, project.pk)
    theirs = listener.token(wakeups.FINISHED, other_project.pk)
    with transaction.atomic():
        wakeups.announce(wakeups.FINISHED, project.pk)
    assert listener.wait(wakeups.FINISHED, project.pk, mine, timeout=10)
    assert not listener.wait(wakeups.FINISHED, other_project.pk, theirs, timeout=0.2)
