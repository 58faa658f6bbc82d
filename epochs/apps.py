"""App configuration for epochs: the production settings check, metrics, engine server controls."""
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
        # Epoch switches and row updates happen where the Engine is: in the engine server when
        # web and worker processes use one.
        from engine.serving import register_control
        from epochs.runtime import activate_by_pk, sync_now

        register_control("activate", activate_by_pk)
        register_control("sync", sync_now)
