"""The benchmarks' own database: migrated and emptied before each run, never another one."""

from __future__ import annotations

import sys

import psycopg
from django.conf import settings
from django.core.management import call_command
from django.db import connection

STORE_TABLES = ["store_span", "store_attempt", "store_rollout", "store_worker",
                "store_resourceversion", "store_resourceset", "store_apikey", "store_project"]


def empty_bench_database(tables: list[str] = STORE_TABLES) -> None:
    """Migrate, then empty `tables`; refuses a database that is not Postgres or whose name
    does not contain "bench" (a benchmark must never wipe real data)."""
    name = connection.settings_dict["NAME"]
    if connection.vendor != "postgresql" or "bench" not in name:
        sys.exit(f"refusing to run: database {name!r} must be Postgres and contain 'bench'")
    create_database_if_missing(name)
    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE")


def create_database_if_missing(name: str) -> None:
    """A fresh machine has no benchmark database yet: create it (as the configured user)."""
    db = settings.DATABASES["default"]
    with psycopg.connect(dbname="postgres", user=db["USER"] or "postgres",
                         password=db["PASSWORD"] or None, host=db["HOST"] or "127.0.0.1",
                         port=db["PORT"] or 5432, autocommit=True) as admin:
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            admin.execute(f'CREATE DATABASE "{name}"')
