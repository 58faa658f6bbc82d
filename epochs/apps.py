"""App configuration for epochs: registers the production settings check and the engine watcher."""
from django.apps import AppConfig


class EpochsConfig(AppConfig):
    name = "epochs"
    verbose_name = "Epochs and row updates"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported for its @register side effect; refusing to start a production process with
        # unsafe settings happens here because gunicorn and Celery never run `manage.py check`.
        from morphoweb import checks

        checks.enforce_production_settings()
        from epochs.metrics import register_collector

        register_collector()
