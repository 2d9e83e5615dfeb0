"""AGL_CURRENT_ROLE, read as AGL reads it (core/agl_roles.py)."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command

from core import agl_roles
from core.agl_roles import Role
from core.queues import Queue


@pytest.mark.parametrize("raw,role,queues", [
    (None, Role.BOTH, (Queue.ROLLOUTS, Queue.TRAINING)),
    ("runner", Role.RUNNER, (Queue.ROLLOUTS,)),
    (" Algorithm ", Role.ALGORITHM, (Queue.TRAINING,)),
])
def test_the_role_decides_the_embedded_queues(monkeypatch, raw, role, queues):
    if raw is None:
        monkeypatch.delenv("AGL_CURRENT_ROLE", raising=False)
    else:
        monkeypatch.setenv("AGL_CURRENT_ROLE", raw)
    assert agl_roles.current_role() == role
    assert agl_roles.embedded_queues(role) == queues


def test_an_unknown_role_fails_loudly(monkeypatch):
    monkeypatch.setenv("AGL_CURRENT_ROLE", "trainer")
    with pytest.raises(ImproperlyConfigured, match="AGL_CURRENT_ROLE"):
        agl_roles.current_role()


def test_the_runner_command_refuses_an_algorithm_process(monkeypatch):
    monkeypatch.setenv("AGL_CURRENT_ROLE", "algorithm")
    with pytest.raises(CommandError, match="runs no rollouts"):
        call_command("runner", "--agent", "x.y:z", "--server", "http://127.0.0.1:9", "--key", "k")
