"""Resources ids become per project: `resources_id` is the public id, unique within a project;
the primary key is an internal key. Existing rows keep their id as both."""

import store.ids
from django.db import migrations, models


def copy_ids(apps, schema_editor) -> None:
    ResourceSet = apps.get_model("store", "ResourceSet")
    ResourceSet.objects.update(resources_id=models.F("id"))


class Migration(migrations.Migration):

    dependencies = [
        ('store', '0004_hot_path_indexes'),
    ]

    operations = [
        migrations.AddField(
            model_name='resourceset',
            name='resources_id',
            field=models.CharField(max_length=40, null=True),
        ),
        migrations.RunPython(copy_ids, migrations.RunPython.noop),
        migrations.AlterField(
            model_name='resourceset',
            name='resources_id',
            field=models.CharField(default=store.ids.new_resources_id, max_length=40),
        ),
        migrations.AddConstraint(
            model_name='resourceset',
            constraint=models.UniqueConstraint(fields=('project', 'resources_id'), name='resourceset_uniq'),
        ),
    ]
