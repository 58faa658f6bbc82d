"""WSGI entry point (gunicorn morphoweb.wsgi); starts this process's engine at load when eager."""
import os

from django.core.wsgi import get_wsgi_application

from morphoweb.gunicorn_errors import install as json_gunicorn_errors

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "morphoweb.settings")

application = get_wsgi_application()

# The apps are loaded (get_wsgi_application set Django up): the engine app's modules may load now.
from engine.config import engine_settings  # noqa: E402
from engine.dashboard import history  # noqa: E402
from engine.holder import get_engine  # noqa: E402
from morphoweb.openapi import SchemaView  # noqa: E402

# Requests gunicorn cannot parse are answered by gunicorn itself: make those answers JSON too.
json_gunicorn_errors()

if engine_settings().eager:
    # Each gunicorn worker imports this module after the fork, so the engine (and its scheduler
    # thread) is created in the process that uses it. A matrix or backend that cannot load
    # stops the boot here with the reason, instead of failing every query later.
    get_engine()

# /api/schema is built once, here, not by concurrent requests (morphoweb/openapi.py).
SchemaView.prebuild()

# The dashboard's last 15 minutes of per-second figures are kept from the start, not from the
# first visit, so the page shows them the moment it opens.
history()
