"""Settings for the test suite: the real Postgres on 127.0.0.1 unless DATABASE_URL says else."""

import os

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/lightning")
os.environ.setdefault("DJANGO_SECRET_KEY", "test-suite-only")

from lightning_site.settings import *  # noqa: E402,F403
