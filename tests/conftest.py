from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from store import services
from store.models import Attempt, Project, Rollout
from store.services import RolloutSpec
from tests.celery_fixtures import (  # noqa: F401 - fixtures for tests with real Celery workers
    broker,
    broker_url,
    celery_worker_env,
    celery_workers,
    rabbitmq_url,
    redis_key_prefix,
    redis_url,
    sending_to,
)


def pytest_collection_modifyitems(config, items):
    """The SQLite run (lightning_site/settings_sqlite.py) skips tests marked `postgres`."""
    from django.conf import settings

    if "postgresql" in settings.DATABASES["default"]["ENGINE"]:
        return
    skip = pytest.mark.skip(reason="a Postgres-only path (this run is on SQLite)")
    for item in items:
        if item.get_closest_marker("postgres"):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _wakeup_listener_closed_before_teardown(django_db_setup, django_db_blocker):
    """The wake-up listener's connection would keep the test database from being dropped."""
    yield
    from store import wakeups

    wakeups.stop_listener()


@pytest.fixture
def project(db) -> Project:
    return services.project_create(name="proj")


@pytest.fixture
def other_project(db) -> Project:
    return services.project_create(name="other")


def enqueue(project: Project, n: int = 1, **kwargs) -> list[Rollout]:
    specs = [RolloutSpec(input={"i": i}, **kwargs) for i in range(n)]
    return services.rollout_enqueue_many(project=project, specs=specs)


def claim(project: Project, worker_id: str = "w1") -> tuple[Rollout, Attempt]:
    claimed = services.rollout_dequeue(project=project, worker_id=worker_id)
    assert claimed is not None
    return claimed


def backdate(attempt: Attempt, seconds: float) -> None:
    """Move an attempt's clock into the past, as if it started `seconds` ago."""
    shift = timedelta(seconds=seconds)
    attempt.refresh_from_db()
    Attempt.objects.filter(pk=attempt.pk).update(
        start_time=attempt.start_time - shift,
        last_heartbeat_time=(attempt.last_heartbeat_time - shift)
        if attempt.last_heartbeat_time else None,
        deadline=(attempt.deadline - shift) if attempt.deadline else None,
    )


def terminate_backend() -> None:
    """The server ends this thread's database connection (Django does not know yet), as a
    Postgres restart or an idle timeout would."""
    from django.db import connection, connections

    pid = connection.connection.info.backend_pid
    killer = connections.create_connection("default")
    try:
        with killer.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])
    finally:
        killer.close()


def now():
    return timezone.now()


@pytest.fixture
def staff(client):
    """The test client, logged in as a superuser (the admin, job pages, console)."""
    from django.contrib.auth.models import User

    client.force_login(User.objects.create_superuser("ops", "ops@example.com", "pw"))
    return client


@pytest.fixture
def live_site(request):
    """The app served on the test module's SERVER_ADDR (for a real browser); its URL."""
    from pytest_django.live_server_helper import LiveServer

    addr = request.module.SERVER_ADDR
    server = LiveServer(addr)
    try:
        yield f"http://{addr}"
    finally:
        server.stop()
