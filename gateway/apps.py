from django.apps import AppConfig


class GatewayConfig(AppConfig):
    """The data plane holds no tables; as an app it hands the web its readers of what the
    gateway processes on this machine count now (access.live)."""

    name = "gateway"
    verbose_name = "Gateway"

    def ready(self) -> None:
        # Here, not at the top: apps.py is imported while the apps load, before models exist.
        from django.conf import settings

        from access import live

        from . import fairqueue, limits

        live.readers.register(
            use=limits.live_use,
            waiting=lambda models: fairqueue.waiting_on_machine(
                settings.VAR_DIR / "gateway-queue", models
            ),
        )
