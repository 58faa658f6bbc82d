"""App configuration for queries: the query metrics from the start, bulk jobs on the dashboard,
bulk files deleted with their job, the Celery worker's receivers."""
from django.apps import AppConfig
from django.db.models.signals import post_delete

from engine import dashboard


class QueriesConfig(AppConfig):
    name = "queries"
    verbose_name = "PIR queries"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # These modules read the models: they load once the app registry is ready, here. The
        # metrics' import also registers the query metrics, so /metrics lists them before the
        # first query.
        from queries import bulk_files, worker
        from queries.metrics import dashboard_figures
        from queries.models import BulkJob

        dashboard.add_figures(dashboard_figures)
        post_delete.connect(bulk_files.job_deleted, sender=BulkJob,
                            dispatch_uid="bulk-job-files")
        worker.connect()
