# The span epoch's table (README "Span sequence ids and crashes", store/services/_rows.py
# server_epoch): UNLOGGED, so Postgres empties it in every crash recovery. Postgres only (on
# SQLite commits are never asynchronous); not a model, so a test's flush leaves it alone, as
# a running deployment's would be.

from django.db import migrations

TABLE = "store_span_epoch"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f"CREATE UNLOGGED TABLE IF NOT EXISTS {TABLE} "
            "(id integer PRIMARY KEY CHECK (id = 1), started timestamptz NOT NULL)"
        )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP TABLE IF EXISTS {TABLE}")


class Migration(migrations.Migration):

    dependencies = [
        ("store", "0014_span_ids_reserved"),
    ]

    operations = [migrations.RunPython(create, drop)]
