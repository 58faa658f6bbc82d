"""WSGI entry point (gunicorn morphoweb.wsgi); starts this process's engine at load when eager."""
import os

from django.conf import settings
from django.core.wsgi import get_wsgi_application

from morphoweb.gunicorn_errors import install as json_gunicorn_errors

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "morphoweb.settings")

application = get_wsgi_application()

# Requests gunicorn cannot parse are answered by gunicorn itself: make those answers JSON too.
json_gunicorn_errors()

if settings.MORPHO_ENGINE_EAGER:
    # Each gunicorn worker imports this module after the fork, so the engine (and its scheduler
    # thread) is created in the process that uses it. A matrix or backend that cannot load
    # stops the boot here with the reason, instead of failing every query later.
    from morphoweb.engine_runtime import get_engine

    get_engine()

# The dashboard's last 15 minutes of per-second figures are kept from the start, not from the
# first visit, so the page shows them the moment it opens.
from morphoweb.dashboard import history  # noqa: E402

history()
