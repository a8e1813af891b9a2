"""Make sure an admin account and its API token exist, and print how to use them."""

from __future__ import annotations

import os
import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from rest_framework.authtoken.models import Token


class Command(BaseCommand):
    help = "Create (once) the admin user and its API token; print how to log in."

    def add_arguments(self, parser):
        parser.add_argument("--username", default=os.environ.get("LLMGW_ADMIN_USER", "admin"))

    def handle(self, *args, **options):
        User = get_user_model()
        username = options["username"]
        password_file = settings.VAR_DIR / "admin-password"
        user = User.objects.filter(username=username).first()
        if user is None:
            password = os.environ.get("LLMGW_ADMIN_PASSWORD") or secrets.token_urlsafe(12)
            user = User.objects.create_superuser(username=username, email="", password=password)
            password_file.write_text(password + "\n")
            password_file.chmod(0o600)
        password = (
            password_file.read_text().strip()
            if password_file.exists()
            else "(set before; unchanged)"
        )
        token, _ = Token.objects.get_or_create(user=user)
        url = settings.LLMGW_PUBLIC_URL
        self.stdout.write(
            f"\n  Console and admin: {url}/  (user {username}, password {password})\n"
            f"  API docs:          {url}/api/v1/docs\n"
            f"  llmgw ctl:         export LLMGW_URL={url} LLMGW_TOKEN={token.key}\n"
            f"                     .venv/bin/llmgw ctl models\n"
        )
