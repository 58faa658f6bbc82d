"""The Celery application, configured from Django settings (CELERY_* names)."""
from __future__ import annotations

import os
from pathlib import Path

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "morphoweb.settings")

app = Celery("morphoweb")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.on_after_configure.connect
def _make_filesystem_broker_folders(sender: Celery, **kwargs) -> None:
    # Kombu's filesystem transport writes into its folders but does not create the data folder;
    # the embedded default must work on a fresh clone.
    options = sender.conf.broker_transport_options or {}
    for key in ("data_folder_in", "data_folder_out", "control_folder"):
        if options.get(key):
            Path(options[key]).mkdir(parents=True, exist_ok=True)
