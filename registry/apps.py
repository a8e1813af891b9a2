from django.apps import AppConfig


class RegistryConfig(AppConfig):
    name = "registry"
    verbose_name = "Registry"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # In ready(): the receivers reach models, which exist only once every app is loaded.
        from . import receivers  # noqa: F401  (connects the catalog's model_added signal)
