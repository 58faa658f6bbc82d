"""App config of the engine app: the Django side of the engine, which other apps build on.

It imports gpu_engine and Django, never the policies, epochs or queries apps: they hook in from
their own ready() (engine.signals, engine.serving.register_control, engine.metrics'
read_policies_with, engine.dashboard.add_figures).
"""
from django.apps import AppConfig

from engine.config import engine_settings
from engine.metrics import register_collector


class EngineConfig(AppConfig):
    name = "engine"
    verbose_name = "Engine server"

    def ready(self) -> None:
        engine_settings()  # a bad engine setting stops every process before it serves
        register_collector()
