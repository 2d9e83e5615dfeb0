"""`manage.py` says in one line what is wrong with the database (with the command that fixes
it), and stops quietly when its reader goes away (`./lightning train_list | head`)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PG = "postgres://postgres@127.0.0.1:5432"


def manage(*args: str, database_url: str | None = None, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "DJANGO_SECRET_KEY": "test", "DJANGO_SETTINGS_MODULE":
           "lightning_site.settings"}
    env.pop("DATABASE_URL", None)
    if database_url:
        env["DATABASE_URL"] = database_url
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, **kwargs)


def assert_one_line(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.postgres
def test_a_missing_database_is_one_line_with_the_fix():
    name = f"missing_{uuid.uuid4().hex[:8]}"
    result = manage("train_list", database_url=f"{PG}/{name}")
    assert_one_line(result, f'database "{name}" does not exist', f"createdb {name}",
                    "./lightning migrate")


@pytest.mark.postgres
def test_an_unmigrated_database_is_one_line_naming_migrate():
    name = f"empty_{uuid.uuid4().hex[:8]}"
    subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-qc",
                    f"CREATE DATABASE {name}"], check=True)
    try:
        result = manage("train_list", database_url=f"{PG}/{name}")
    finally:
        subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-qc",
                        f"DROP DATABASE {name}"], check=True)
    assert_one_line(result, f"the database '{name}' has no table", "./lightning migrate")


def test_an_unreachable_database_is_one_line():
    result = manage("train_list", database_url="postgres://postgres@127.0.0.1:9/x")
    assert_one_line(result, "cannot reach the database", "is PostgreSQL running")


def test_a_reader_that_went_away_ends_the_command_quietly():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "lightning_site.settings"}
    env.pop("DATABASE_URL", None)
    proc = subprocess.Popen([sys.executable, "manage.py", "help"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command writes: every write it makes fails (EPIPE)
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
    assert proc.returncode == 141
