"""Make sure an admin account exists; the first time, print its password and an API token.

Neither is kept in plain text: the password only as Django's hash, the token only as a
SHA-256 (accounts.ApiToken). So both are shown once, when they are made; later starts say
how to get new ones.
"""

from __future__ import annotations

import os
import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from accounts.services import token_create

# The ctl token is not a gateway key: an OpenAI client needs one made for it.
CLIENTS_LINE = (
    "  OpenAI clients:    base_url {url}/v1, api_key from `.venv/bin/llmgw ctl key create NAME`\n"
)


class Command(BaseCommand):
    help = "Create (once) the admin user and an API token, printing them that once."

    def add_arguments(self, parser):
        parser.add_argument("--username", default=os.environ.get("LLMGW_ADMIN_USER", "admin"))

    def handle(self, *args, **options):
        User = get_user_model()
        username = options["username"]
        url = settings.LLMGW_PUBLIC_URL
        user = User.objects.filter(username=username).first()
        if user is not None:
            self.stdout.write(
                f"\n  Console and admin: {url}/  (user {username}; its password was printed when "
                f"it was made; set a new one with `manage.py changepassword {username}`)\n"
                f"  API docs:          {url}/api/v1/docs\n"
                f"  llmgw ctl:         LLMGW_TOKEN as printed at the first start; a new token: "
                f"`manage.py llmgw_token {username}`\n"
                f"{CLIENTS_LINE.format(url=url)}"
            )
            return
        given = os.environ.get("LLMGW_ADMIN_PASSWORD")
        password = given or secrets.token_urlsafe(12)
        user = User.objects.create_superuser(username=username, email="", password=password)
        _, token = token_create(user=user, name="printed by the run command")
        shown = "from LLMGW_ADMIN_PASSWORD" if given else password
        self.stdout.write(
            f"\n  Console and admin: {url}/  (user {username}, password {shown})\n"
            f"  API docs:          {url}/api/v1/docs\n"
            f"  llmgw ctl:         export LLMGW_URL={url} LLMGW_TOKEN={token}\n"
            f"                     .venv/bin/llmgw ctl models\n"
            f"{CLIENTS_LINE.format(url=url)}"
            f"  The password and the token are shown only now: keep them.\n"
        )
