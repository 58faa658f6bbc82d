"""gunicorn's settings for `gunicorn morphoweb.wsgi` run from the repository (or the image's /app).

Web processes are thin clients of the engine server when MORPHO_ENGINE_URL is set, so there are
as many as the machine has cores; without an engine server each process would load its own copy
of the matrix, so there is one. Options on the command line override these.

The web processes count their metrics in prometheus_client's multiprocess mode, so that /metrics
gives the party's figures whichever process answers (engine.metrics.party_registry): the folder
PROMETHEUS_MULTIPROC_DIR (default: a temporary one, removed when gunicorn stops) is emptied at
start, and a process that ends leaves its counters there while its live gauges go with it.
"""
import os
import shutil
import tempfile
from pathlib import Path

# Set before prometheus_client is imported (it reads the variable at import): the web processes
# gunicorn forks inherit it.
_metrics_dir_given = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
if not _metrics_dir_given:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="morphoweb-metrics-")
_metrics_dir = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])

from prometheus_client import multiprocess  # noqa: E402

_engine_server = bool(os.environ.get("MORPHO_ENGINE_URL", "").strip())
# web worker processes (MORPHO_WEB_WORKERS; default: the core count with an engine server, else 1)
workers = int(os.environ.get("MORPHO_WEB_WORKERS") or ((os.cpu_count() or 1) if _engine_server else 1))
# request threads per worker process (MORPHO_WEB_THREADS): each waits on the engine for its answer
threads = int(os.environ.get("MORPHO_WEB_THREADS") or 8)
worker_class = "gthread"
# seconds a worker may stay silent before the master restarts it (a long query waits up to
# MORPHO_QUERY_TIMEOUT, 60 s by default)
timeout = 120
# No shared control socket under ~/.gunicorn: several parties on one host would delete each
# other's. `make run` gives each party its own under its state folder.
control_socket_disable = not os.environ.get("MORPHO_GUNICORN_CONTROL_SOCKET")
control_socket = os.environ.get("MORPHO_GUNICORN_CONTROL_SOCKET") or "gunicorn.ctl"
# The mask gunicorn binds a Unix socket under: 0660, this user's and group's (gunicorn's default
# of 0 made it 0777, and any local user could reach gunicorn around the front end).
umask = 0o117


def on_starting(server):
    """Counters of an earlier run in the folder would be added to this one's: start empty."""
    _metrics_dir.mkdir(parents=True, exist_ok=True)
    for stale in _metrics_dir.glob("*.db"):
        stale.unlink()


def child_exit(server, worker):
    """A web process ended: its live gauges go; its counters stay in the party's sums."""
    multiprocess.mark_process_dead(worker.pid)


def on_exit(server):
    if not _metrics_dir_given:
        shutil.rmtree(_metrics_dir, ignore_errors=True)
