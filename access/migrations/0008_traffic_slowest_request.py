"""The slowest answer of each traffic row, with its request's ID (X-Request-ID), so that a slow
minute on a chart leads to one request whose log lines and trace can be looked up.

As for the fair queue's columns (0007), each has a database default as well as Django's, so the
rows already written read as having no slowest request known (0 s, no ID), and a gateway process still running the code
of before this migration goes on writing its rows.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    replaces = [
        ("gateway", "0008_traffic_slowest_request")
    ]  # made by the gateway app, before it moved here
    dependencies = [
        ("access", "0007_traffic_queue"),
    ]

    operations = [
        migrations.AddField(
            model_name="trafficminute",
            name="slowest_request",
            field=models.CharField(
                blank=True,
                db_default="",
                default="",
                help_text="that request's ID (X-Request-ID)",
                max_length=64,
            ),
        ),
        migrations.AddField(
            model_name="trafficminute",
            name="slowest_seconds",
            field=models.FloatField(
                db_default=0, default=0, help_text="the longest time spent answering one request"
            ),
        ),
    ]
