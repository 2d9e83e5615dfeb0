"""Fewer indexes on the hot tables: every non-HOT update and every insert maintains each one.

Dropped: single-column foreign-key indexes that a composite index leading with the same column
already serves, the span -> rollout constraint (the attempt's constraint covers the row), and
Django's `varchar_pattern_ops` copy of the rollout primary key (nothing queries ids by LIKE).
"""

import django.db.models.deletion
from django.db import migrations, models


def _pattern_index_sql(schema_editor, drop: bool) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    name = schema_editor._create_index_name("store_rollout", ["id"], suffix="_like")
    if drop:
        schema_editor.execute(f'DROP INDEX IF EXISTS "{name}"')
    else:
        schema_editor.execute(
            f'CREATE INDEX IF NOT EXISTS "{name}" ON "store_rollout" ("id" varchar_pattern_ops)'
        )


def drop_pattern_index(apps, schema_editor) -> None:
    _pattern_index_sql(schema_editor, drop=True)


def create_pattern_index(apps, schema_editor) -> None:
    _pattern_index_sql(schema_editor, drop=False)


class Migration(migrations.Migration):

    dependencies = [
        ('store', '0003_queue_table_autovacuum'),
    ]

    operations = [
        migrations.RunPython(drop_pattern_index, create_pattern_index),
        migrations.AlterField(
            model_name='attempt',
            name='rollout',
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='attempts', to='store.rollout'),
        ),
        migrations.AlterField(
            model_name='rollout',
            name='project',
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='rollouts', to='store.project'),
        ),
        migrations.AlterField(
            model_name='span',
            name='attempt',
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='spans', to='store.attempt'),
        ),
        migrations.AlterField(
            model_name='span',
            name='rollout',
            field=models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='spans', to='store.rollout'),
        ),
        migrations.AlterField(
            model_name='worker',
            name='project',
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='workers', to='store.project'),
        ),
    ]
