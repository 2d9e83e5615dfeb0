from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('trainer', '0005_gang_member'),
    ]

    operations = [
        migrations.AddField(
            model_name='trainingstep',
            name='trained',
            field=models.JSONField(blank=True, default=list),
        ),
    ]
