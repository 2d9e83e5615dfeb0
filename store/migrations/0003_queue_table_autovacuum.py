"""Queue-table hygiene on Postgres: every claim and report rewrites a rollout and an attempt,
so dead rows pile up in the claim index and row estimates go stale far sooner than the 20 %
default thresholds notice. Vacuum and analyze these tables after 2 % of their rows change."""

from django.db import migrations

TABLES = ["store_rollout", "store_attempt", "store_worker"]
SETTINGS = (
    "autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02, "
    "autovacuum_vacuum_threshold = 1000, autovacuum_analyze_threshold = 1000"
)


def tune(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for table in TABLES:
        schema_editor.execute(f'ALTER TABLE "{table}" SET ({SETTINGS})')


def untune(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    names = ", ".join(part.split("=")[0].strip() for part in SETTINGS.split(","))
    for table in TABLES:
        schema_editor.execute(f'ALTER TABLE "{table}" RESET ({names})')


class Migration(migrations.Migration):
    dependencies = [("store", "0002_rollout_dispatch")]

    operations = [migrations.RunPython(tune, untune)]
