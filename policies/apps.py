"""App configuration for policies: every engine this process builds follows the active records."""
from django.apps import AppConfig

from engine.metrics import read_policies_with
from engine.signals import engine_built


class PoliciesConfig(AppConfig):
    name = "policies"
    verbose_name = "Batching policies"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # policies.source reads the models: it loads once the app registry is ready, here.
        from policies.source import attach, current_policies

        engine_built.connect(attach, dispatch_uid="policies.attach")
        read_policies_with(current_policies)
