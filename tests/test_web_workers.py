"""The API server's default number of processes (lightning_site/web.py): $WEB_WORKERS, else
half the CPUs this process may run on, at least one; gunicorn's settings take the same."""

from __future__ import annotations

import importlib

import pytest

from lightning_site import web


@pytest.mark.parametrize(("cpus", "expected"), [(1, 1), (2, 1), (3, 1), (4, 2), (8, 4), (16, 8)])
def test_half_the_cpus_at_least_one(monkeypatch, cpus, expected):
    monkeypatch.delenv("WEB_WORKERS", raising=False)
    monkeypatch.setattr(web.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert web.default_workers() == expected


def test_without_cpu_affinity_the_cpu_count(monkeypatch):
    monkeypatch.delenv("WEB_WORKERS", raising=False)
    monkeypatch.delattr(web.os, "sched_getaffinity", raising=False)  # macOS, Windows
    monkeypatch.setattr(web.os, "cpu_count", lambda: 8)
    assert web.default_workers() == 4
    monkeypatch.setattr(web.os, "cpu_count", lambda: None)  # undeterminable
    assert web.default_workers() == 1


def test_web_workers_overrides(monkeypatch):
    monkeypatch.setattr(web.os, "sched_getaffinity", lambda pid: set(range(2)))
    monkeypatch.setenv("WEB_WORKERS", "3")
    assert web.default_workers() == 3
    monkeypatch.setenv("WEB_WORKERS", "")  # set but empty: the default
    assert web.default_workers() == 1


def test_the_flag_and_gunicorn_take_the_default(monkeypatch):
    monkeypatch.delenv("WEB_WORKERS", raising=False)
    monkeypatch.setattr(web.os, "sched_getaffinity", lambda pid: set(range(6)))
    seen = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: seen.update(kwargs))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    monkeypatch.setenv("WEB_THREADS", "8")  # main() sets it for its processes
    web.main([])
    assert seen["workers"] == 3
    conf = importlib.reload(importlib.import_module("lightning_site.gunicorn_conf"))
    assert conf.workers == 3
