"""A step's rollouts become the members of a store rollout group (store 0007) instead of the
rollouts whose idempotency key starts with "job/<job>/step/<n>/".

Forward: every round of every step gets its group, with the rollouts its keys named as
members and the counts they have; the step points at its current round's group. Backward:
members without an idempotency key (planned after this migration) get the key the old code
looks for, in plan order, so a downgraded trainer finds them."""

import django.db.models.deletion
from django.db import migrations, models

TERMINAL = ("succeeded", "failed", "cancelled")


def _old_key(job_id, n, round, index):
    middle = f"r{round}/" if round else ""
    return f"job/{job_id}/step/{n}/{middle}{index}"


def _old_members(Rollout, step, round):
    """The rollouts the old key scheme gave this round of the step."""
    prefix = f"job/{step.job_id}/step/{step.n}/" + (f"r{round}/" if round else "")
    members = []
    for rollout in Rollout.objects.filter(project_id=step.job.project_id,
                                          idempotency_key__startswith=prefix):
        rest = rollout.idempotency_key[len(prefix):]
        if rest.isdigit():  # ".../step/3/7" is round 0's; ".../step/3/r1/7" is not
            members.append(rollout)
    return members


def forward(apps, schema_editor):
    TrainingStep = apps.get_model("trainer", "TrainingStep")
    Rollout = apps.get_model("store", "Rollout")
    RolloutGroup = apps.get_model("store", "RolloutGroup")
    for step in TrainingStep.objects.select_related("job").order_by("pk").iterator():
        for round in range(step.round + 1):
            members = _old_members(Rollout, step, round)
            finished = sum(1 for r in members if r.status in TERMINAL)
            group, _ = RolloutGroup.objects.get_or_create(
                project_id=step.job.project_id, key=f"trainer/step/{step.pk}/r{round}",
                defaults={"owner": "trainer", "total": len(members), "finished": finished,
                          "completed_at": step.updated_at if finished >= len(members) else None},
            )
            Rollout.objects.filter(pk__in=[r.pk for r in members]).update(group=group)
            if round == step.round:
                TrainingStep.objects.filter(pk=step.pk).update(group=group)


def backward(apps, schema_editor):
    TrainingStep = apps.get_model("trainer", "TrainingStep")
    Rollout = apps.get_model("store", "Rollout")
    RolloutGroup = apps.get_model("store", "RolloutGroup")
    for step in TrainingStep.objects.select_related("job").order_by("pk").iterator():
        for round in range(step.round + 1):
            group = RolloutGroup.objects.filter(
                project_id=step.job.project_id, key=f"trainer/step/{step.pk}/r{round}").first()
            if group is None:
                continue
            members = Rollout.objects.filter(group=group).order_by("start_time", "pk")
            for index, rollout in enumerate(members):
                if not rollout.idempotency_key:
                    rollout.idempotency_key = _old_key(step.job_id, step.n, round, index)
                    rollout.save(update_fields=["idempotency_key"])


class Migration(migrations.Migration):

    dependencies = [
        ('store', '0007_rollout_groups'),
        ('trainer', '0002_job_paused'),
    ]

    operations = [
        migrations.AddField(
            model_name='trainingstep',
            name='group',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='training_steps', to='store.rolloutgroup'),
        ),
        migrations.RunPython(forward, backward),
    ]
