from django.db import migrations


def create_row(apps, schema_editor):
    CatalogVersion = apps.get_model("catalog", "CatalogVersion")
    CatalogVersion.objects.get_or_create(pk=1)


class Migration(migrations.Migration):
    dependencies = [("catalog", "0001_initial")]
    operations = [migrations.RunPython(create_row, migrations.RunPython.noop)]
