"""Tokens issued before were DRF authtoken rows, kept in plain text: keep them working, as
hashes, and remove the plain text.

Read with SQL because the authtoken app is no longer installed; an installation that never
had it has no table and nothing to move.
"""

import hashlib

from django.db import migrations


def hash_plaintext_tokens(apps, schema_editor):
    connection = schema_editor.connection
    if "authtoken_token" not in connection.introspection.table_names():
        return
    ApiToken = apps.get_model("accounts", "ApiToken")
    with connection.cursor() as cursor:
        cursor.execute("SELECT key, user_id FROM authtoken_token")
        rows = cursor.fetchall()
    for key, user_id in rows:
        digest = hashlib.sha256(key.encode()).hexdigest()
        if not ApiToken.objects.filter(digest=digest).exists():
            ApiToken.objects.create(
                user_id=user_id,
                name="issued before tokens were hashed",
                prefix=key[:6],
                digest=digest,
            )
    schema_editor.execute("DROP TABLE authtoken_token")


class Migration(migrations.Migration):
    dependencies = [("accounts", "0001_initial")]

    operations = [migrations.RunPython(hash_plaintext_tokens, migrations.RunPython.noop)]
