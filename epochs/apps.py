"""App configuration for epochs: engines follow the database's epoch, metrics, engine controls."""
from django.apps import AppConfig

from engine import dashboard
from engine.serving import register_control
from engine.signals import engine_started, starting_epoch


class EpochsConfig(AppConfig):
    name = "epochs"
    verbose_name = "Epochs and row updates"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # These modules read the models: they load once the app registry is ready, here.
        from epochs import sync
        from epochs.metrics import dashboard_figures, register_collector

        # Every engine this process starts serves the database's epoch and row updates first:
        # it is built on the active epoch's file, then brought to its pending row updates.
        starting_epoch.connect(sync.starting_epoch, dispatch_uid="epochs.starting_epoch")
        engine_started.connect(sync.adopt, dispatch_uid="epochs.adopt")
        register_collector()
        dashboard.add_figures(dashboard_figures)
        # Epoch switches and row updates happen where the Engine is: in the engine server when
        # web and worker processes use one.
        register_control("activate", sync.activate_by_pk)
        register_control("sync", sync.sync_now)
