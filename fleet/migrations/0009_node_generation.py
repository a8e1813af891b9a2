from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("fleet", "0008_modelfile_block_count")]

    operations = [
        migrations.AddField(
            model_name="node",
            name="generation",
            field=models.PositiveBigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="node",
            name="report_digest",
            field=models.CharField(blank=True, default="", max_length=64),
        ),
    ]
