"""Django settings for morphoweb: every value comes from the environment, with a default."""
from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path

import ipaddress

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from morphoweb.envcheck import host_problem, parse_rate, unknown_names
from morpho_pir.protocol import MAX_BATCH_QUERIES

BASE_DIR = Path(__file__).resolve().parent.parent
# Every environment name a setting reads: any other MORPHO_*/DJANGO_* name is a misspelling
# (warned about, refused in production) at the end of this module.
_READ: set[str] = set()


def _env(name: str, default: str) -> str:
    _READ.add(name)
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def _env_bool(name: str, default: bool) -> bool:
    _READ.add(name)
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ImproperlyConfigured(f"{name}: expected true/false (1/0, yes/no, on/off), got {raw!r}")


def _env_int(
    name: str, default: int | None, lo: int | None = None, hi: int | None = None
) -> int | None:
    _READ.add(name)
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}: expected an integer, got {raw!r}") from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ImproperlyConfigured(f"{name}: expected an integer in {lo}..{hi}, got {value}")
    return value


def _env_float(name: str, default: float, lo: float | None = None) -> float:
    _READ.add(name)
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}: expected a number, got {raw!r}") from None
    if lo is not None and value < lo:
        raise ImproperlyConfigured(f"{name}: expected a number >= {lo}, got {value}")
    return value


def _env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in _env(name, default).split(",") if item.strip()]


def _env_rate(name: str, default: str) -> str | None:
    """A request rate, "N/second|minute|hour|day" with N >= 1, normalised; None for "off"."""
    try:
        return parse_rate(name, _env(name, default))
    except ValueError as exc:
        raise ImproperlyConfigured(str(exc)) from None


# Directory for the embedded defaults (SQLite database, Celery's file broker, demo matrix).
VAR_DIR = Path(_env("MORPHO_VAR_DIR", str(BASE_DIR / "var")))

# --- Core Django -------------------------------------------------------------------------------

# Signing key (string). The default is for local runs only; production sets its own.
SECRET_KEY = _env("SECRET_KEY", "morphoweb-insecure-local-default-change-me")
# Debug pages and tracebacks (bool). Off by default: an API error must never show a traceback.
DEBUG = _env_bool("DEBUG", False)
# Host names this server answers for (comma-separated list).
ALLOWED_HOSTS = _env_list("ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]")
for _host in ALLOWED_HOSTS:
    if host_problem(_host):
        raise ImproperlyConfigured(f"ALLOWED_HOSTS: expected {host_problem(_host)}, got {_host!r}")

INSTALLED_APPS = [
    # First: its createsuperuser, changepassword and drf_create_token (morphoweb/management)
    # take the place of Django's and DRF's, and refuse a missing or unmigrated database.
    "morphoweb",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    # Bulk jobs authenticate with DRF tokens (`manage.py drf_create_token USER`) or a session.
    "rest_framework.authtoken",
    "django_prometheus",
    "policies",
    "queries",
    "epochs",
    # The engine server's command (`manage.py serve_engine`) and its control operations.
    "engine",
    # The OpenAPI schema at /api/schema (the fuzz tests run schemathesis against it).
    "drf_spectacular",
    # Swagger UI's files for /api/docs, served from here: the page works without internet.
    "drf_spectacular_sidecar",
]

MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    # First of ours: an oversized body is refused before anything reads it.
    "morphoweb.middleware.BodySizeLimitMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Static files (the admin's styles and scripts, the API docs) from STATIC_ROOT, no web server.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    # /bulk/jobs/ and /api/epochs answer like /bulk/jobs and /api/epochs/ (no redirect).
    "morphoweb.middleware.OptionalSlashMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # django-prometheus's, with the method label bounded (engine/prometheus.py).
    "engine.prometheus.BoundedMethodMiddleware",
]

ROOT_URLCONF = "morphoweb.urls"
# A form post without its CSRF token is refused in JSON too, like every other error.
CSRF_FAILURE_VIEW = "queries.api.errors.csrf_failure"
WSGI_APPLICATION = "morphoweb.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "morphoweb.context_processors.party",
            ],
        },
    },
]

# --- Database ----------------------------------------------------------------------------------

# Database URL (dj-database-url syntax). Default: a SQLite file under MORPHO_VAR_DIR.
DATABASE_URL = _env("DATABASE_URL", f"sqlite:///{VAR_DIR / 'db.sqlite3'}")
if DATABASE_URL.startswith("sqlite:"):
    # SQLite does not create the folder of its file; the default lives in var/, which a fresh
    # clone does not have.
    VAR_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)  # the database is no one else's
DATABASES = {
    "default": dj_database_url.parse(
        DATABASE_URL,
        # Seconds a connection is kept open between requests (0 = close after each request).
        conn_max_age=_env_int("DATABASE_CONN_MAX_AGE", 0, lo=0),
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Web processes and Celery workers write the same file: WAL lets readers run beside a writer,
    # IMMEDIATE takes the write lock at BEGIN (no deadlocked lock upgrades), and a writer waits
    # up to `timeout` seconds for the lock instead of failing with "database is locked".
    DATABASES["default"].setdefault("OPTIONS", {}).update({
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    })
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Cache --------------------------------------------------------------------------------------

# Cache URL: unset = this process's memory (Django's LocMemCache); redis://host:6379/2 = Redis,
# shared by every process of the party. The request limits count in Redis when it is set
# (queries/api/throttling.py), and per process otherwise.
CACHE_URL = _env("CACHE_URL", "")
if CACHE_URL.startswith(("redis://", "rediss://", "unix://")):
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                          "LOCATION": CACHE_URL}}
elif CACHE_URL:
    raise ImproperlyConfigured(
        f"CACHE_URL: expected redis://host:port/db or nothing, got {CACHE_URL!r}"
    )
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# --- Static files, i18n ------------------------------------------------------------------------

STATIC_URL = "static/"
# Where `manage.py collectstatic` gathers the static files WhiteNoise serves (path); `make run` and
# the Docker image collect them.
STATIC_ROOT = Path(_env("STATIC_ROOT", str(BASE_DIR / "staticfiles")))
# Not collected yet (a bare `gunicorn morphoweb.wsgi` in a fresh clone): serve the files from the
# apps' own static folders instead, so the admin never loses its styles.
WHITENOISE_USE_FINDERS = not (STATIC_ROOT / "admin").is_dir()
if WHITENOISE_USE_FINDERS:
    # WhiteNoise would warn at every start that STATIC_ROOT is missing; the finders stand in.
    warnings.filterwarnings("ignore", message="No directory at: " + re.escape(str(STATIC_ROOT)))
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# --- REST framework ----------------------------------------------------------------------------

REST_FRAMEWORK = {
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["queries.api.parsers.StrictJSONParser"],
    # Parse errors, validation errors and engine refusals all become JSON with the field named.
    "EXCEPTION_HANDLER": "queries.api.errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # Every listing (/api/*, /bulk/jobs) is paged alike: ?limit= (default 100, at most 1000)
    # and ?offset=, answered as {"count", "next", "previous", "results"}.
    "DEFAULT_PAGINATION_CLASS": "morphoweb.pagination.ListPagination",
    # Anonymous requests (the public PIR endpoints) are limited per client address, counted
    # atomically (queries/api/throttling.py); signed-in operators are not.
    "DEFAULT_THROTTLE_CLASSES": ["queries.api.throttling.AnonQueryThrottle"],
    # Requests per client address ("N/second|minute|hour|day", N >= 1), in Redis when CACHE_URL
    # names one, else per process; "off" lifts the limit (load generators on one address need it).
    "DEFAULT_THROTTLE_RATES": {"anon": _env_rate("MORPHO_QUERY_THROTTLE", "200/second")},
    # Reverse proxies in front of this server (count). 0: the client address is the socket's, and
    # a client cannot escape its limit by sending its own X-Forwarded-For.
    "NUM_PROXIES": _env_int("MORPHO_NUM_PROXIES", 0, lo=0),
}
SPECTACULAR_SETTINGS = {
    "TITLE": "morphoweb",
    "DESCRIPTION": "Two-server private page queries (docs/PROTOCOL.md) and their operations API.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # /api/docs takes Swagger UI from the drf-spectacular-sidecar package, not from a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    # Every operation's error responses (400, 401/403 or 429/503, ...) with their JSON body.
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "morphoweb.openapi.document_errors",
    ],
}
# Deployment kind: "production" makes the process refuse to start with DEBUG on, a weak or
# default SECRET_KEY or no ALLOWED_HOSTS (morphoweb/checks.py); "local" checks none of that. Any
# other value is refused: a typo must not start a production party as a local one.
MORPHO_ENVS = ("local", "production")
MORPHO_ENV = _env("MORPHO_ENV", "local").strip().lower()
if MORPHO_ENV not in MORPHO_ENVS:
    raise ImproperlyConfigured(
        f"MORPHO_ENV: expected {' or '.join(MORPHO_ENVS)}, got {os.environ.get('MORPHO_ENV')!r}"
    )

# Which party this is, as its operators call it ("A", "B", a name): shown in the admin's header,
# the dashboard and the landing page, so that two parties' tabs side by side are told apart.
# `make run` sets A and B; empty shows no name. At most 40 printable characters.
MORPHO_PARTY_NAME = _env("MORPHO_PARTY_NAME", "").strip()
if len(MORPHO_PARTY_NAME) > 40 or not MORPHO_PARTY_NAME.isprintable():
    raise ImproperlyConfigured(
        f"MORPHO_PARTY_NAME: expected at most 40 printable characters, got {MORPHO_PARTY_NAME!r}")

# --- The PIR engine ----------------------------------------------------------------------------
# Parsed here; read by the code only through engine.config.engine_settings(), one frozen value
# that checks the engine's settings together (their bounds, the backend's name) at start-up.

# The matrix file this party serves (path; raw pages of 4096 bytes, sidecar <path>.epoch.json),
# in a folder of its own: not beside the database, broker or sockets of VAR_DIR.
MORPHO_MATRIX_PATH = Path(_env("MORPHO_MATRIX_PATH", str(VAR_DIR / "matrices" / "matrix.bin")))
# The only folder epoch matrix files may come from (path; epochs/matrix_files.py). Unset = the
# folder of MORPHO_MATRIX_PATH, read when an epoch is recorded or loaded. New epochs are refused
# while it holds any file the party writes (database, broker folder, engine socket).
MORPHO_MATRIX_DIR = Path(_env("MORPHO_MATRIX_DIR", "")) if _env("MORPHO_MATRIX_DIR", "") else None
# Which compute backend answers queries: auto (CUDA when present, else CPU), cpu, or cuda.
MORPHO_ENGINE_BACKEND = _env("MORPHO_ENGINE_BACKEND", "auto").strip().lower()
# The devices one engine owns, as ids "0,1,..." (GPUs for CUDA; simulated devices for the CPU
# backend); unset = one device, the current one. Each epoch's placement says how pages go on them.
MORPHO_ENGINE_DEVICES = _env("MORPHO_ENGINE_DEVICES", "").strip()
# How the CUDA backend scans v2 keys: auto (the tensor cores from 18 keys a launch, where the GPU
# has 1-bit products; the ALU below), mma (always the tensor cores) or alu (never); answers are the
# same bytes. The CPU backend has one scan and ignores it.
MORPHO_V2_SCAN = _env("MORPHO_V2_SCAN", "auto").strip().lower()
# How the CUDA backend stores the matrix: pages (row-major) or fragments (as the tensor cores read
# it; the faster for v2 keys and for v1 batches of 32 queries). Both answer v1 and v2 keys. The CPU
# backend ignores it.
MORPHO_MATRIX_LAYOUT = _env("MORPHO_MATRIX_LAYOUT", "pages").strip().lower()
# DPF tree depth in bits; unset = the smallest d with 2**d >= number of pages.
MORPHO_DOMAIN_BITS = _env_int("MORPHO_DOMAIN_BITS", None)
# Queries per batch request (count, 1..32).
MORPHO_MAX_BATCH = _env_int("MORPHO_MAX_BATCH", MAX_BATCH_QUERIES, lo=1, hi=MAX_BATCH_QUERIES)
# Largest request body accepted (bytes); a larger one gets 413. 32 queries at d = 32 fit in 128 KiB.
MORPHO_MAX_BODY_BYTES = _env_int("MORPHO_MAX_BODY_BYTES", 256 * 1024, lo=1024)
# Largest bulk job body under /bulk/ (bytes); 100,000 queries at d = 25 are about 300 MB of JSON.
MORPHO_BULK_MAX_BODY_BYTES = _env_int("MORPHO_BULK_MAX_BODY_BYTES", 512 * 1024 * 1024, lo=1024)
# How long a request waits for its answers before giving up with 503 (seconds).
MORPHO_QUERY_TIMEOUT = _env_float("MORPHO_QUERY_TIMEOUT", 60.0, lo=0.001)
# After the engine failed to start, how long to answer 503 before trying again (seconds).
MORPHO_ENGINE_RETRY_AFTER = _env_int("MORPHO_ENGINE_RETRY_AFTER", 5)
# Python's GIL switch interval in processes that run an engine (µs; 0 = Python's own 5000): the
# scheduler thread, request threads and answer callbacks take turns sooner. On the H100 at 90% of
# capacity it cut p95 from 59 to 42 ms and p99 from 94 to 57 ms (docs/PERFORMANCE.md).
MORPHO_GIL_SWITCH_INTERVAL_US = _env_int("MORPHO_GIL_SWITCH_INTERVAL_US", 500)
# Start the engine when the WSGI application loads, so a bad matrix or backend fails the boot
# rather than the first query (bool).
MORPHO_ENGINE_EAGER = _env_bool("MORPHO_ENGINE_EAGER", True)

# The engine server this process submits to (ipc://path or tcp://host:port); empty = build an
# engine in this process (tests, runserver). `manage.py serve_engine` binds this address.
MORPHO_ENGINE_URL = _env("MORPHO_ENGINE_URL", "").strip()
# Seconds of silence after which a client gives up on the engine server: its requests in flight
# fail with 503 and new ones are refused until it answers again.
MORPHO_ENGINE_DEADLINE = _env_float("MORPHO_ENGINE_DEADLINE", 5.0)
# Warm the engine up (every batch size on CUDA) before the engine server takes queries (bool).
MORPHO_ENGINE_WARMUP = _env_bool("MORPHO_ENGINE_WARMUP", True)

# Django's cap on what it reads into memory at once (request.body, form fields; bytes): bulk
# bodies are streamed (queries/api/bulk_parsing.py) and uploaded files spill to disk past 2.5 MB,
# so nothing needs more than a query body; a large form field in a bulk upload is refused.
DATA_UPLOAD_MAX_MEMORY_SIZE = MORPHO_MAX_BODY_BYTES

# --- The front end of `make run` (morphoweb/frontend.py) ---------------------------------------
# It reads each request whole before gunicorn sees it, so a slow client holds a socket, not one
# of gunicorn's threads. docker compose puts nginx there with the same limits (deploy/nginx/).

# From a request's first byte to the end of its head (request line and headers), else 408 (s).
MORPHO_FRONTEND_HEADER_TIMEOUT = _env_float("MORPHO_FRONTEND_HEADER_TIMEOUT", 10.0, lo=0.1)
# Largest request head, request line and headers together, else 431 (bytes).
MORPHO_FRONTEND_MAX_HEADER_BYTES = _env_int("MORPHO_FRONTEND_MAX_HEADER_BYTES", 32 * 1024, lo=1024)
# A body of n bytes must arrive within BODY_TIMEOUT + n / BODY_MIN_RATE seconds, else 408: 10 s
# for a query's body, about 2 h 20 min for a bulk job's 512 MiB.
MORPHO_FRONTEND_BODY_TIMEOUT = _env_float("MORPHO_FRONTEND_BODY_TIMEOUT", 10.0, lo=0.1)
MORPHO_FRONTEND_BODY_MIN_RATE = _env_int("MORPHO_FRONTEND_BODY_MIN_RATE", 64 * 1024, lo=1)
# An idle keep-alive connection is closed after this long (seconds).
MORPHO_FRONTEND_KEEPALIVE_TIMEOUT = _env_float("MORPHO_FRONTEND_KEEPALIVE_TIMEOUT", 15.0, lo=0.1)
# A client that takes none of its response for this long is cut off (seconds).
MORPHO_FRONTEND_SEND_TIMEOUT = _env_float("MORPHO_FRONTEND_SEND_TIMEOUT", 60.0, lo=0.1)
# Silence from gunicorn after which a request gets 504 (seconds): above gunicorn's own worker
# timeout (gunicorn.conf.py, 120 s), so a request that long is gunicorn's to end.
MORPHO_FRONTEND_UPSTREAM_TIMEOUT = _env_float("MORPHO_FRONTEND_UPSTREAM_TIMEOUT", 180.0, lo=0.1)
# Processes sharing the party's port: one proxies a few thousand requests a second, so a quarter
# of the cores, as many as gunicorn's processes need to be kept busy.
MORPHO_FRONTEND_PROCESSES = _env_int("MORPHO_FRONTEND_PROCESSES", max(1, (os.cpu_count() or 1) // 4),
                                     lo=1)
# Connections the port holds at once, over all its processes: beyond it a new connection closes
# the one that has waited longest without a request in progress (an idle keep-alive connection,
# a head still arriving), else gets 503. Each costs a descriptor and a few KiB.
MORPHO_FRONTEND_MAX_CONNECTIONS = _env_int("MORPHO_FRONTEND_MAX_CONNECTIONS", 10000, lo=1)

# --- Celery ------------------------------------------------------------------------------------

# Broker URL. Default: Kombu's filesystem transport under MORPHO_VAR_DIR, which needs no server.
CELERY_BROKER_URL = _env("CELERY_BROKER_URL", "filesystem://")
# Folder the filesystem transport exchanges messages through (path; only for filesystem://).
CELERY_FILESYSTEM_BROKER_DIR = Path(
    _env("CELERY_FILESYSTEM_BROKER_DIR", str(VAR_DIR / "celery-broker"))
)
if CELERY_BROKER_URL.startswith("filesystem:"):
    # Producer and consumer share one folder: what one process writes, the worker reads.
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(CELERY_FILESYSTEM_BROKER_DIR / "queue"),
        "data_folder_out": str(CELERY_FILESYSTEM_BROKER_DIR / "queue"),
        "control_folder": str(CELERY_FILESYSTEM_BROKER_DIR / "control"),
        "store_processed": False,
        # Seconds an idle worker sleeps between looks at the folder (Kombu's default is 1 s).
        "polling_interval": 0.1,
    }
# Result backend URL; unset = none (job results are stored in the database by the app itself).
CELERY_RESULT_BACKEND = _env("CELERY_RESULT_BACKEND", "") or None
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# A task is acknowledged only after it ran, so a worker that dies loses nothing.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# Tasks a worker reserves beyond the one it runs (count): GPU workers take one at a time.
CELERY_WORKER_PREFETCH_MULTIPLIER = _env_int("CELERY_WORKER_PREFETCH_MULTIPLIER", 1, lo=1)
# A worker started before its broker (or after a broker restart) keeps trying to connect.
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# The prefork pool (`--pool prefork` means this one), with queue locks a SIGKILLed pool process
# gives back: billiard's semaphores stay taken and the worker stops consuming (prefork.py).
CELERY_WORKER_POOL = "morphoweb.prefork:TaskPool"

# --- Bulk jobs (queries/bulk.py; workers: bin/gpu-workers) ------------------------------------

# Most queries in one bulk job (count).
MORPHO_BULK_MAX_QUERIES = _env_int("MORPHO_BULK_MAX_QUERIES", 100_000, lo=1)
# Largest query in a bulk body (bytes of JSON, or of one NDJSON line): a body is read one query
# at a time, so this bounds what one request holds of it. A query at d = 32 is about 3.8 KB.
MORPHO_BULK_MAX_QUERY_BYTES = _env_int("MORPHO_BULK_MAX_QUERY_BYTES", 16 * 1024, lo=1024)
# Job submissions per user ("N/second|minute|hour"; "off" lifts the limit), counted like
# MORPHO_QUERY_THROTTLE (in Redis with CACHE_URL, else per process).
MORPHO_BULK_SUBMIT_THROTTLE = _env_rate("MORPHO_BULK_SUBMIT_THROTTLE", "30/hour") or "off"
# Jobs one user may have queued or running at once (count); one more gets 429.
MORPHO_BULK_MAX_ACTIVE_JOBS = _env_int("MORPHO_BULK_MAX_ACTIVE_JOBS", 4, lo=1)
# Bulk bodies one server process reads and validates at once (count); one more gets 503 with
# Retry-After, so submissions never hold all of its threads, nor most of its GIL.
MORPHO_BULK_PARSE_SLOTS = _env_int("MORPHO_BULK_PARSE_SLOTS", 2, lo=1)
# Queries per chunk: one Celery task and one result write each (count).
MORPHO_BULK_CHUNK = _env_int("MORPHO_BULK_CHUNK", 256, lo=1)
# Celery queue every GPU worker consumes; worker i also consumes "<queue>.<i>".
MORPHO_BULK_QUEUE = _env("MORPHO_BULK_QUEUE", "gpu")
# A running chunk whose worker stopped renewing it for this long is queued again (seconds).
MORPHO_BULK_LEASE_SECONDS = _env_float("MORPHO_BULK_LEASE_SECONDS", 30.0, lo=0.5)
# A queued chunk not taken this long after its task was sent is sent again (seconds): the
# broker may have lost the message; a duplicate is harmless. A broker restart seen by a worker's
# connection is handled at once (queries/tasks.py, BrokerWatch); this is the backstop.
MORPHO_BULK_REQUEUE_SECONDS = _env_float("MORPHO_BULK_REQUEUE_SECONDS", 300.0, lo=0.5)
# How often each worker looks for such chunks (seconds).
MORPHO_BULK_SWEEP_SECONDS = _env_float("MORPHO_BULK_SWEEP_SECONDS", 5.0, lo=0.1)

# --- Metrics -----------------------------------------------------------------------------------

# Client networks that may read /metrics without signing in (comma-separated addresses or CIDR
# networks; "*": anyone). Others get 403 unless signed in as staff (an admin session, or a DRF
# token: Prometheus's `authorization: {type: Token, credentials: ...}`). The client address is
# the one the request rates count (MORPHO_NUM_PROXIES). Default: loopback and private networks,
# where a Prometheus of the same host or of docker compose scrapes from.
_METRICS_ALLOW = _env("MORPHO_METRICS_ALLOW",
                      "127.0.0.0/8,::1,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,fc00::/7")
try:
    MORPHO_METRICS_ALLOW = None if _METRICS_ALLOW.strip() == "*" else [
        ipaddress.ip_network(item.strip()) for item in _METRICS_ALLOW.split(",") if item.strip()]
except ValueError as _exc:
    raise ImproperlyConfigured(f"MORPHO_METRICS_ALLOW: expected * or comma-separated addresses "
                               f"or networks (10.0.0.0/8), got {_METRICS_ALLOW!r} ({_exc})") from None

# --- Logging -----------------------------------------------------------------------------------

# Log level for morphoweb, queries, policies and gpu_engine (DEBUG, INFO, WARNING, ...).
MORPHO_LOG_LEVEL = _env("MORPHO_LOG_LEVEL", "INFO").upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s"},
    },
    "filters": {
        # A 503 is a refusal the API documents (engine not ready, overloaded), not a bug.
        "not_refusals": {"()": "django.utils.log.CallbackFilter",
                         "callback": lambda record: getattr(record, "status_code", None) != 503},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain"},
        "server_errors": {"class": "logging.StreamHandler", "formatter": "plain",
                          "filters": ["not_refusals"]},
    },
    "loggers": {
        **{name: {"handlers": ["console"], "level": MORPHO_LOG_LEVEL, "propagate": False}
           for name in ("morphoweb", "engine", "queries", "policies", "epochs", "gpu_engine")},
        # Every 500 with its traceback, whatever DEBUG says (Django's own console handler logs
        # only with DEBUG on, and mails admins no one configured): a 500 is a bug to be read.
        # ERROR: the 4xx lines of this logger are warnings and stay out.
        "django.request": {"handlers": ["server_errors"], "level": "ERROR", "propagate": False},
    },
}

# --- Names no setting reads --------------------------------------------------------------------
# A misspelled name (MORPHO_QUERY_THROTLE, DJANGO_DEBUG, ALLOWED_HOST) would otherwise leave its
# setting at the default without a word: warned about here, and refused in production, where a
# setting silently left at its default can open the party up.
for _line in unknown_names(os.environ, _READ):
    if MORPHO_ENV == "production":
        raise ImproperlyConfigured(f"refusing to start with MORPHO_ENV=production: {_line}")
    print(f"morphoweb settings: warning: {_line}", file=sys.stderr, flush=True)
