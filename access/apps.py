from django.apps import AppConfig
from django.db.models.signals import post_migrate


class AccessConfig(AppConfig):
    name = "access"
    verbose_name = "Access and usage"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        post_migrate.connect(_ensure_triggers, sender=self)


def _ensure_triggers(sender: object, using: str = "default", **kwargs: object) -> None:
    """After every migrate: a migration that rebuilt a watched table (SQLite) dropped its triggers."""
    # Here, not at the top: apps.py is imported while the apps load, before models exist.
    from django.db import connections

    from . import triggers

    triggers.ensure(connections[using])
