# Crash safety of the span ids `spans/next` hands out asynchronously (rules.SPAN_BASE).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('store', '0013_span_json_encoder'),
    ]

    operations = [
        migrations.AddField(
            model_name='rollout',
            name='span_epoch',
            field=models.DateTimeField(blank=True, null=True),
        ),
        # Rollouts from before: every id they handed out was committed synchronously, so
        # none is above their counter and none needs skipping (0: the counter itself).
        migrations.AddField(
            model_name='rollout',
            name='span_ids_reserved',
            field=models.IntegerField(default=0),
            preserve_default=False,
        ),
        # New rollouts: their first rules.SPAN_ID_BLOCK ids (no SQL: Django keeps this
        # default in Python).
        migrations.AlterField(
            model_name='rollout',
            name='span_ids_reserved',
            field=models.IntegerField(default=1025),
        ),
    ]
