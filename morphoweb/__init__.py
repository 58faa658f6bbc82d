"""The morphoweb Django project; importing it also loads the Celery app so tasks bind to it."""
from morphoweb.celery import app as celery_app

__all__ = ["celery_app"]
