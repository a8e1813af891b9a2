import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("fleet", "0010_reconcilerun")]

    operations = [
        migrations.CreateModel(
            name="RemovedNode",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("token_hash", models.CharField(max_length=64, unique=True)),
                ("name", models.CharField(max_length=100)),
                ("removed_by", models.CharField(max_length=150)),
                ("door", models.CharField(blank=True, default="", max_length=20)),
                (
                    "removed_at",
                    models.DateTimeField(db_index=True, default=django.utils.timezone.now),
                ),
            ],
        ),
    ]
