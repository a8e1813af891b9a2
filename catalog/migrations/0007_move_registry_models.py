"""Fetch, MirrorFile and Rollout now belong to the registry app (registry 0001).

Only the catalog's idea of its models changes; the tables and their rows stay where they are.
"""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("catalog", "0006_model_canary"),
        ("registry", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name="Rollout"),
                migrations.DeleteModel(name="Fetch"),
                migrations.DeleteModel(name="MirrorFile"),
            ],
            database_operations=[],
        ),
    ]
