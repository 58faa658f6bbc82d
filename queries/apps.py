"""App configuration for queries: the query metrics from the start, bulk jobs on the dashboard."""
from django.apps import AppConfig

from engine import dashboard


class QueriesConfig(AppConfig):
    name = "queries"
    verbose_name = "PIR queries"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # queries.metrics reads the models: it loads once the app registry is ready, here. Its
        # import also registers the query metrics, so /metrics lists them before the first query.
        from queries.metrics import dashboard_figures

        dashboard.add_figures(dashboard_figures)
