"""Issue a new API token for a user and print it (the only time it is shown)."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from accounts.services import token_create


class Command(BaseCommand):
    help = "Issue a new API token for USER (for llmgw ctl and scripts); it is printed only now."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--name", default="", help="what the token is for")

    def handle(self, *args, **options):
        user = get_user_model().objects.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"There is no user named {options['username']!r}.")
        _, secret = token_create(user=user, name=options["name"])
        self.stdout.write(secret)
