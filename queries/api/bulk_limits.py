"""Limits on bulk submissions: a rate and a quota per user, a few bodies read at once per process.

Checked before the body is read, except the rate, which DRF checks first of all; whatever the
answer, the rest of the body is drained, so the client reads it instead of a reset connection.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

from django.conf import settings
from django.http.request import UnreadablePostError
from rest_framework import exceptions, status

from queries.api.throttling import AtomicRateThrottle
from queries.api.bulk_parsing import READ_BYTES
from queries.models import ACTIVE, BulkJob

QUOTA_RETRY_AFTER = 30  # seconds: a job takes at least that long to finish
SLOT_RETRY_AFTER = 5  # seconds before a client whose body found every reading slot taken retries


class BulkSubmitThrottle(AtomicRateThrottle):
    """Job submissions per user: MORPHO_BULK_SUBMIT_THROTTLE ("N/second|minute|hour", or off)."""

    scope = "bulk_submit"

    def get_rate(self):
        rate = settings.MORPHO_BULK_SUBMIT_THROTTLE
        return None if rate.lower() == "off" else rate

    def get_cache_key(self, request, view):
        user = request.user
        if not (user and user.is_authenticated):
            return None  # anonymous submissions get their 401 anyway
        return f"throttle_{self.scope}_{user.pk}"


class _Refusal(exceptions.APIException):
    wait = 1  # seconds; DRF's exception handler sends it as Retry-After

    def __init__(self, detail: str) -> None:
        super().__init__(detail)


class QuotaExceeded(_Refusal):
    status_code = status.HTTP_429_TOO_MANY_REQUESTS
    default_code = "quota"
    wait = QUOTA_RETRY_AFTER


class SlotsBusy(_Refusal):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_code = "busy"
    wait = SLOT_RETRY_AFTER


def check_quota(user) -> None:
    """At most MORPHO_BULK_MAX_ACTIVE_JOBS of a user's jobs queued or running at once."""
    limit = settings.MORPHO_BULK_MAX_ACTIVE_JOBS
    active = BulkJob.objects.filter(owner=user, status__in=ACTIVE).count()
    if active >= limit:
        raise QuotaExceeded(
            f"{active} of your bulk jobs are queued or running, expected fewer than {limit} "
            f"(MORPHO_BULK_MAX_ACTIVE_JOBS): wait for one to finish, or cancel one"
        )


class _Slots:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.busy = 0

    @contextmanager
    def reading(self):
        """Hold one of MORPHO_BULK_PARSE_SLOTS while a body is read and checked, or 503."""
        with self._lock:
            limit = settings.MORPHO_BULK_PARSE_SLOTS
            if self.busy >= limit:
                raise SlotsBusy(
                    f"{self.busy} bulk submissions are being read by this server "
                    f"(MORPHO_BULK_PARSE_SLOTS={limit}); retry shortly")
            self.busy += 1
        try:
            yield
        finally:
            with self._lock:
                self.busy -= 1


# Per process: submissions never take all of a server's threads (or its GIL) from the queries.
slots = _Slots()


def drain(request) -> None:
    """Read and drop what is left of the request body (one READ_BYTES buffer at a time)."""
    raw = getattr(request, "_request", request)  # DRF's Request wraps Django's
    try:
        while raw.read(READ_BYTES):
            pass
    except (OSError, UnreadablePostError, ValueError):
        pass  # the client went away: nobody to answer
