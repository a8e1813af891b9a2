from django.apps import AppConfig
from django.contrib.auth.signals import user_logged_in
from django.db.backends.signals import connection_created

from .private_files import restrict_sqlite_database


class SiteConfig(AppConfig):
    name = "llmgw_site"
    verbose_name = "llmgw site"

    def ready(self) -> None:
        # In ready(): it reaches django-axes' models, which exist only once every app is loaded.
        from .login_throttle import forget_own_failures

        connection_created.connect(restrict_sqlite_database, dispatch_uid="llmgw-sqlite-owner-only")
        user_logged_in.connect(forget_own_failures, dispatch_uid="llmgw-forget-own-failures")
