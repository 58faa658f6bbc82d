"""Production safety: with MORPHO_ENV=production, unsafe settings are errors and stop the process."""
from __future__ import annotations

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

# Secret keys that ship in code (ours and Django's startproject prefix) and are no secret.
KNOWN_DEFAULT_KEY_PREFIXES = ("morphoweb-insecure", "django-insecure")
# Django's own deploy check (security.W009) wants 50 characters and 5 distinct ones; a generated
# key (secrets.token_urlsafe(50), Django's get_random_secret_key) has 30 to 45 distinct ones, so
# 20 refuses repeated or patterned keys ('a' * 60, 'abab...') and no generated one. A hex key
# (`openssl rand -hex 32`, secrets.token_hex(32)) has at most 16: 64 hex digits with 10 distinct.
MIN_SECRET_KEY_LENGTH = 50
MIN_SECRET_KEY_DISTINCT = 20
MIN_HEX_KEY_LENGTH = 64
MIN_HEX_KEY_DISTINCT = 10
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def secret_key_problem(key: str) -> str | None:
    """Why `key` is not a real secret, or None. Surrounding whitespace does not count."""
    if key.startswith(KNOWN_DEFAULT_KEY_PREFIXES):
        return "is a default that ships in code"
    core = key.strip()
    if len(core) < MIN_SECRET_KEY_LENGTH:
        return (f"has {len(core)} characters besides surrounding whitespace, expected at least "
                f"{MIN_SECRET_KEY_LENGTH}")
    distinct = len(set(core))
    if set(core) <= _HEX_DIGITS:
        if len(core) < MIN_HEX_KEY_LENGTH or distinct < MIN_HEX_KEY_DISTINCT:
            return (f"is {len(core)} hex digits with {distinct} distinct ones, expected at least "
                    f"{MIN_HEX_KEY_LENGTH} digits with {MIN_HEX_KEY_DISTINCT} distinct ones")
    elif distinct < MIN_SECRET_KEY_DISTINCT:
        return (f"has {distinct} distinct characters, expected at least {MIN_SECRET_KEY_DISTINCT} "
                f"(a repeated or patterned value is no secret)")
    return None


def production_problems() -> list[checks.Error]:
    """Errors for DEBUG on, a weak SECRET_KEY, or no ALLOWED_HOSTS; [] when not production."""
    if getattr(settings, "MORPHO_ENV", "local") != "production":
        return []
    errors = []
    if settings.DEBUG:
        errors.append(checks.Error(
            "DEBUG is on in production: error pages would show tracebacks and settings.",
            hint="Set DEBUG=false (or leave it unset).", id="morphoweb.E001"))
    problem = secret_key_problem(settings.SECRET_KEY or "")
    if problem:
        errors.append(checks.Error(
            f"SECRET_KEY {problem}: sessions and admin logins could be forged.",
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
