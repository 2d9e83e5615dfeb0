"""Settings for the store's and trainer's service tests on the embedded SQLite default (the
database `./lightning train` uses with no DATABASE_URL), so the Postgres fast paths and the
portable ORM paths are held to the same tests: `./lightning test_sqlite` (part of
`./lightning test`)."""

import os

# The embedded default: no DATABASE_URL (the Postgres test suite's one is ignored here).
os.environ["DATABASE_URL"] = ""
os.environ.setdefault("DJANGO_SECRET_KEY", "test-suite-only")

from core.env import sqlite_database  # noqa: E402
from lightning_site.settings import *  # noqa: E402,F403
from lightning_site.settings import DATA_DIR  # noqa: E402

DATABASES = {"default": sqlite_database(DATA_DIR / "test-sqlite" / "lightning.sqlite3")}
