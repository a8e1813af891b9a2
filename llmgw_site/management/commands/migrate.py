"""Django's migrate, under the database's start-up lock (llmgw_site.startlock): machines that
migrate one new database at the same moment take turns, and the later ones find nothing to do,
where together they would create the same tables twice."""

from __future__ import annotations

from typing import Any

from django.core.management.commands.migrate import Command as DjangoMigrate

from llmgw_site.startlock import startup_lock


class Command(DjangoMigrate):
    def handle(self, *args: Any, **options: Any) -> Any:
        with startup_lock(options["database"], say=self.stdout.write):
            return super().handle(*args, **options)
