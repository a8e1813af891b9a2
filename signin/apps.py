from __future__ import annotations

from django.apps import AppConfig
from django.core.exceptions import ImproperlyConfigured


class SigninConfig(AppConfig):
    name = "signin"
    verbose_name = "Sign-in"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import audit
        from .oidc import ProviderConfig

        audit.connect()
        config = ProviderConfig.from_settings()
        if config is None:
            return
        problems = config.problems()
        if problems:
            # Every process refuses to start: a web process that starts anyway would show a
            # sign-in button that fails for everyone.
            raise ImproperlyConfigured(
                "Sign-in through a provider (LLMGW_OIDC_ISSUER) cannot work: "
                + "; ".join(p.rstrip(".") for p in problems)
                + ". Fix these, or unset LLMGW_OIDC_ISSUER to turn it off."
            )
