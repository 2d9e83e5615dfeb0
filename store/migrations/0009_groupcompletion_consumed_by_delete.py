# A group's completion is consumed by deleting it (store.services.groups.group_completions_take):
# the events already consumed (processed_at set) go, and so does the column.

from django.db import migrations, models


def delete_consumed(apps, schema_editor):
    GroupCompletion = apps.get_model("store", "GroupCompletion")
    GroupCompletion.objects.filter(processed_at__isnull=False).delete()


class Migration(migrations.Migration):

    dependencies = [
        ('store', '0008_apikey_site_admin_role'),
    ]

    operations = [
        # Irreversible in content (consumed events are gone), reversible in schema.
        migrations.RunPython(delete_consumed, migrations.RunPython.noop),
        migrations.RemoveIndex(
            model_name='groupcompletion',
            name='groupcompletion_pending',
        ),
        migrations.RemoveField(
            model_name='groupcompletion',
            name='processed_at',
        ),
        migrations.AddIndex(
            model_name='groupcompletion',
            index=models.Index(fields=['owner', 'created_at'], name='groupcompletion_owner'),
        ),
    ]
