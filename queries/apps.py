"""App configuration for queries."""
from django.apps import AppConfig


class QueriesConfig(AppConfig):
    name = "queries"
    verbose_name = "PIR queries"
    default_auto_field = "django.db.models.BigAutoField"
