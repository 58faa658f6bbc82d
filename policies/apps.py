"""App configuration for policies: exports the engine and policy metrics once the app is ready."""
from django.apps import AppConfig


class PoliciesConfig(AppConfig):
    name = "policies"
    verbose_name = "Batching policies"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from policies.metrics import register_collector

        register_collector()
