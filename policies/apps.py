"""App configuration for policies."""
from django.apps import AppConfig


class PoliciesConfig(AppConfig):
    name = "policies"
    verbose_name = "Batching policies"
    default_auto_field = "django.db.models.BigAutoField"
