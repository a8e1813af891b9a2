from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0007_gpu_devices"),
    ]

    operations = [
        migrations.AddField(
            model_name="modelfile",
            name="block_count",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
    ]
