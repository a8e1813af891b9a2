"""The content types (and so the permissions and the admin's history) of the models that moved
here from the gateway app follow them: rows made under app_label "gateway" are relabelled, unless
this app already has its own (a database that was migrated before this step cannot have both)."""

from django.db import migrations

MOVED = (
    "team",
    "gatewaykey",
    "keypolicy",
    "userweight",
    "deletedgatewaykey",
    "routingversion",
    "trafficminute",
    "keyusageday",
)


def relabel(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    db = schema_editor.connection.alias
    have = set(
        ContentType.objects.using(db).filter(app_label="access").values_list("model", flat=True)
    )
    ContentType.objects.using(db).filter(app_label="gateway", model__in=MOVED).exclude(
        model__in=have
    ).update(app_label="access")


class Migration(migrations.Migration):
    dependencies = [
        ("access", "0010_user_weight"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [migrations.RunPython(relabel, migrations.RunPython.noop)]
