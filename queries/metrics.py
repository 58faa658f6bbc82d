"""Prometheus metrics of the query endpoints (django-prometheus's registry, `/metrics`): HTTP query
counts and durations, by endpoint; and the bulk jobs the operator dashboard lists."""
from __future__ import annotations

import functools
import time
from typing import Callable

from prometheus_client import Counter, Histogram

from gpu_engine.engine_stats import SECONDS_BOUNDS
from queries.models import BulkJob, JobStatus

BULK_JOBS_SHOWN = 20

QUERY_COUNT = Counter("pir_query_count", "PIR queries answered over HTTP, by endpoint "
                      "(a batch request counts each of its queries).", ["endpoint"])
QUERY_DURATION = Histogram("pir_query_duration_seconds", "Time from request to response of a PIR "
                           "query endpoint, by endpoint.", ["endpoint"], buckets=SECONDS_BOUNDS)


def observe_query(endpoint: str, queries: Callable[[object], int] = lambda response: 1):
    """Decorate a view method: count `queries(response)` answered queries and time the request.

    Only successful responses (status < 400) count as answered queries; every request is timed."""
    def decorate(view_method):
        @functools.wraps(view_method)
        def wrapper(self, request, *args, **kwargs):
            started = time.perf_counter()
            try:
                response = view_method(self, request, *args, **kwargs)
            finally:
                QUERY_DURATION.labels(endpoint).observe(time.perf_counter() - started)
            if getattr(response, "status_code", 500) < 400:
                QUERY_COUNT.labels(endpoint).inc(queries(response))
            return response
        return wrapper
    return decorate


def dashboard_figures() -> dict:
    """The dashboard's bulk jobs still queued or running, oldest first, answered launch by launch
    (running chunks included: BulkJob.answered_so_far)."""
    running = BulkJob.objects.filter(status__in=(JobStatus.QUEUED, JobStatus.RUNNING)).order_by("created")
    return {"bulk_jobs": [{"id": str(job.pk), "status": job.status,
                           "answered": job.answered_so_far(), "total": job.total}
                          for job in running[:BULK_JOBS_SHOWN]]}
