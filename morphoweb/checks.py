"""Production safety: with MORPHO_ENV=production, unsafe settings are errors and stop the process."""
from __future__ import annotations

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

# Secret keys that ship in code (ours and Django's startproject prefix) and are no secret.
KNOWN_DEFAULT_KEY_PREFIXES = ("morphoweb-insecure", "django-insecure")
MIN_SECRET_KEY_LENGTH = 32


def production_problems() -> list[checks.Error]:
    """Errors for DEBUG on, a default or short SECRET_KEY, or no ALLOWED_HOSTS; [] when not production."""
    if getattr(settings, "MORPHO_ENV", "local") != "production":
        return []
    errors = []
    if settings.DEBUG:
        errors.append(checks.Error(
            "DEBUG is on in production: error pages would show tracebacks and settings.",
            hint="Set DEBUG=false (or leave it unset).", id="morphoweb.E001"))
    key = settings.SECRET_KEY or ""
    if key.startswith(KNOWN_DEFAULT_KEY_PREFIXES) or len(key) < MIN_SECRET_KEY_LENGTH:
        errors.append(checks.Error(
            "SECRET_KEY is a default or shorter than "
            f"{MIN_SECRET_KEY_LENGTH} characters: sessions and admin logins could be forged.",
            hint="Set SECRET_KEY to a long random value, e.g. "
                 "`python -c 'import secrets; print(secrets.token_urlsafe(50))'`.",
            id="morphoweb.E002"))
    hosts = [h for h in settings.ALLOWED_HOSTS if h.strip()]
    if not hosts or "*" in hosts:
        errors.append(checks.Error(
            f"ALLOWED_HOSTS is {hosts!r}: production needs the host names this party answers for.",
            hint="Set ALLOWED_HOSTS=pir.example.org (comma-separated).", id="morphoweb.E003"))
    return errors


@checks.register(checks.Tags.security)
def production_settings_check(app_configs=None, **kwargs):
    """`manage.py check` (and runserver, migrate) report the production problems as errors."""
    return production_problems()


def enforce_production_settings() -> None:
    """Raise ImproperlyConfigured at start-up (gunicorn, Celery, manage.py) when production is unsafe."""
    problems = production_problems()
    if problems:
        raise ImproperlyConfigured(
            "refusing to start with MORPHO_ENV=production: "
            + " ".join(f"[{p.id}] {p.msg} {p.hint}" for p in problems)
        )
