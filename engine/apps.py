"""App config of the engine app."""
from django.apps import AppConfig


class EngineConfig(AppConfig):
    name = "engine"
    verbose_name = "Engine server"
