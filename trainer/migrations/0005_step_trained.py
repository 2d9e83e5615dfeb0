from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('trainer', '0004_step_stale_replans'),
    ]

    operations = [
        migrations.AddField(
            model_name='trainingstep',
            name='trained',
            field=models.JSONField(blank=True, default=list),
        ),
    ]
