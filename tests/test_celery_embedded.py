"""The embedded default: no DATABASE_URL, no CELERY_BROKER_URL; SQLite, in-process workers."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

from tests.celery_fixtures import ROOT

pytestmark = pytest.mark.slow
ENQUEUE_ONLY = """
from runners.services import rollouts_enqueue_for_celery
from store.services import RolloutSpec, project_create
rollouts_enqueue_for_celery(project=project_create(name="demo"),
    specs=[RolloutSpec(input={"i": 1}) for _ in range(3)], agent="tests.celery_agents:ok_agent")
"""


def manage(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(LIGHTNING_DATA_DIR=str(tmp_path), PYTHONPATH=str(ROOT), LOG_LEVEL="WARNING")
    result = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def counts(tmp_path) -> dict[str, int]:
    with sqlite3.connect(tmp_path / "lightning.sqlite3") as db:
        rollouts = dict(db.execute("SELECT status, count(*) FROM store_rollout GROUP BY status"))
        rollouts["spans"] = db.execute("SELECT count(*) FROM store_span").fetchone()[0]
        return rollouts


def test_the_embedded_default_runs_a_batch_end_to_end_on_sqlite(tmp_path):
    manage(tmp_path, "migrate", "-v0")
    # No workers in this process: its in-memory messages die with it, the rows stay queued...
    manage(tmp_path, "shell", "-c", ENQUEUE_ONLY)
    assert counts(tmp_path) == {"queuing": 3, "spans": 0}
    # ...and the next embedded run sends them again, beside its own batch.
    result = manage(tmp_path, "rollouts_enqueue", "demo", "--count", "30",
                    "--agent", "tests.celery_agents:ok_agent", "--input", '{"i": 2}')
    assert '{"succeeded": 30}' in result.stdout
    assert counts(tmp_path) == {"succeeded": 33, "spans": 4 * 33}
