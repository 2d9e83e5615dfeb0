"""Span sequence ids are issued per rollout, shared by its attempts (AGL 0.3's counter): the
counter moves from the attempt to the rollout, starting past every id its spans used."""

from django.db import migrations, models
from django.db.models import Max


def counters_to_rollouts(apps, schema_editor) -> None:
    Rollout = apps.get_model("store", "Rollout")
    Span = apps.get_model("store", "Span")
    Attempt = apps.get_model("store", "Attempt")
    issued = dict(Attempt.objects.values("rollout_id").annotate(n=Max("next_span_sequence_id"))
                  .values_list("rollout_id", "n"))
    used = dict(Span.objects.values("rollout_id").annotate(n=Max("sequence_id"))
                .values_list("rollout_id", "n"))
    for rollout_id in set(issued) | set(used):
        start = max(issued.get(rollout_id) or 1, (used.get(rollout_id) or 0) + 1)
        if start > 1:
            Rollout.objects.filter(pk=rollout_id).update(next_span_sequence_id=start)


class Migration(migrations.Migration):

    dependencies = [
        ('store', '0005_resources_id_per_project'),
    ]

    operations = [
        migrations.AddField(
            model_name='rollout',
            name='next_span_sequence_id',
            field=models.PositiveIntegerField(default=1),
        ),
        migrations.RunPython(counters_to_rollouts, migrations.RunPython.noop),
        migrations.RemoveField(
            model_name='attempt',
            name='next_span_sequence_id',
        ),
    ]
