"""App config of the project itself: the production settings checks run in every process."""
from django.apps import AppConfig

from morphoweb import checks


class MorphowebConfig(AppConfig):
    name = "morphoweb"
    verbose_name = "morphoweb"

    def ready(self) -> None:
        # gunicorn and Celery never run `manage.py check`: a production process with unsafe
        # settings is refused here (importing checks registered them with `manage.py check`).
        checks.enforce_production_settings()
