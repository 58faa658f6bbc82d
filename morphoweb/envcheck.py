"""Settings' values checked at start and environment names no setting reads (spelled wrong)."""
from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping

# Names of ours read outside morphoweb/settings.py: by gunicorn.conf.py, `make run`, bin/gpu-workers,
# the client, docker-compose.yml and the image, and the tests and benchmarks.
READ_ELSEWHERE = frozenset({
    "MORPHO_WEB_WORKERS", "MORPHO_WEB_THREADS", "MORPHO_GUNICORN_CONTROL_SOCKET",
    "MORPHO_GPU_WORKERS", "MORPHO_BULK_CONCURRENCY", "MORPHO_TOKEN_A", "MORPHO_TOKEN_B",
    "MORPHO_GPU_A", "MORPHO_GPU_B", "MORPHO_IMAGE_EXTRAS", "MORPHO_IMAGE_TAG", "MORPHO_EXTRAS",
    "MORPHO_WEB_UPSTREAM", "MORPHO_PROXY_PORT", "MORPHO_SCREENSHOT_DIR", "MORPHO_TEST_NGINX",
    "MORPHO_TEST_IMAGE_EXTRAS",
})
# Django's own (django-admin, the test runner, createsuperuser --no-input, runserver).
DJANGO_NAMES = frozenset({
    "DJANGO_SETTINGS_MODULE", "DJANGO_COLORS", "DJANGO_ALLOW_ASYNC_UNSAFE", "DJANGO_AUTO_COMPLETE",
    "DJANGO_AUTORELOAD_ENV", "DJANGO_WATCHMAN_TIMEOUT", "DJANGO_TEST_PROCESSES",
    "DJANGO_RUNSERVER_HIDE_WARNING", "DJANGO_LIVE_TEST_SERVER_ADDRESS",
})
DJANGO_PREFIXES = ("DJANGO_SUPERUSER_",)  # DJANGO_SUPERUSER_<field> for createsuperuser
OUR_PREFIXES = ("MORPHO_", "DJANGO_")
# An unprefixed name this close to a setting's (difflib's ratio) is taken for a misspelling of it:
# ALLOWED_HOST, SECRETKEY. Unrelated variables of the shell (PATH, HOME, LANG) are far below.
MISSPELLING_RATIO = 0.85

RATE_UNITS = {"s": "second", "sec": "second", "second": "second", "seconds": "second",
              "m": "minute", "min": "minute", "minute": "minute", "minutes": "minute",
              "h": "hour", "hour": "hour", "hours": "hour",
              "d": "day", "day": "day", "days": "day"}
_RATE = re.compile(r"\s*(\d+)\s*/\s*([a-zA-Z]+)\s*")
# A host pattern: a name or address, `.name` for a domain and its subdomains, `*` for any.
_HOST = re.compile(r"\.?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?|\[[0-9A-Fa-f:.]+\]|\*")


def parse_rate(name: str, raw: str) -> str | None:
    """A request rate "N/second|minute|hour|day" (N >= 1) as DRF's throttles read it, or None for
    "off"; ValueError naming the setting and what it expects otherwise."""
    if raw.strip().lower() == "off":
        return None
    match = _RATE.fullmatch(raw)
    unit = RATE_UNITS.get(match.group(2).lower()) if match else None
    if unit is None or int(match.group(1)) < 1:
        raise ValueError(f"{name}: expected N/second, N/minute, N/hour or N/day with N >= 1, or "
                         f"off, got {raw!r}")
    return f"{int(match.group(1))}/{unit}"


def host_problem(host: str) -> str | None:
    """Why an ALLOWED_HOSTS entry cannot be meant, or None: it must be a host name or address
    (no scheme, port or path), and a leading-dot pattern must name a domain, not a whole top-level
    one (".com" would answer for every .com name)."""
    if not _HOST.fullmatch(host):
        return "a host name or address without scheme, port or path"
    if host.startswith(".") and host.strip(".").count(".") < 1:
        return "a domain of at least two labels after a leading dot (.example.org)"
    return None


def unknown_names(environ: Mapping[str, str], known: Iterable[str]) -> list[str]:
    """One line per environment name that no setting reads: MORPHO_* and DJANGO_* names, and
    others spelled nearly as a setting; each says which setting it may have meant."""
    known = set(known) | READ_ELSEWHERE | DJANGO_NAMES
    unprefixed = sorted(name for name in known if not name.startswith(OUR_PREFIXES))
    lines = []
    for name in sorted(environ):
        if name in known or name.startswith(DJANGO_PREFIXES):
            continue
        if name.startswith(OUR_PREFIXES):
            bare = name.split("_", 1)[1]
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6) or (
                [bare] if bare in known else [])
        else:
            close = difflib.get_close_matches(name, unprefixed, n=1, cutoff=MISSPELLING_RATIO)
            if not close:
                continue
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"{name} is not a setting this server reads{hint}")
    return lines
