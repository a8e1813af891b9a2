"""The fair queue's figures in the traffic table: requests that waited for a free slot, their
seconds in the queue (summed, and the longest), waits that timed out and requests refused because
the queue was full.

Each column has a database default of 0 as well as Django's, so the rows already written read as
"nobody waited", and a gateway process still running the code of before this migration (another
machine, mid-upgrade) goes on writing its rows instead of failing on a NOT NULL column.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    replaces = [("gateway", "0007_traffic_queue")]  # made by the gateway app, before it moved here
    dependencies = [
        ("access", "0006_teams_and_limits"),
    ]

    operations = [
        migrations.AddField(
            model_name="trafficminute",
            name="queue_full",
            field=models.PositiveIntegerField(
                db_default=0,
                default=0,
                help_text="requests refused at once because the queue was full (LLMGW_QUEUE_MAX), answered 429",
            ),
        ),
        migrations.AddField(
            model_name="trafficminute",
            name="queue_seconds",
            field=models.FloatField(
                db_default=0, default=0, help_text="their time in the queue, summed"
            ),
        ),
        migrations.AddField(
            model_name="trafficminute",
            name="queue_seconds_max",
            field=models.FloatField(
                db_default=0, default=0, help_text="the longest of those waits"
            ),
        ),
        migrations.AddField(
            model_name="trafficminute",
            name="queue_timeouts",
            field=models.PositiveIntegerField(
                db_default=0,
                default=0,
                help_text="waits that ran out (LLMGW_QUEUE_TIMEOUT), answered 503",
            ),
        ),
        migrations.AddField(
            model_name="trafficminute",
            name="queued",
            field=models.PositiveIntegerField(
                db_default=0,
                default=0,
                help_text="requests that waited in the gateway for a free slot (then served, timed out or hung up)",
            ),
        ),
    ]
