from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("fleet", "0009_node_generation")]

    operations = [
        migrations.CreateModel(
            name="ReconcileRun",
            fields=[
                (
                    "id",
                    models.PositiveSmallIntegerField(default=1, primary_key=True, serialize=False),
                ),
                ("started_at", models.DateTimeField()),
                ("seconds", models.FloatField(default=0)),
            ],
        ),
    ]
