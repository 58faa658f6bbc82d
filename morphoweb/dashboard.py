"""The operator dashboard (staff only): one page, fed every second by a JSON view of the very
figures `/metrics` exports from this process's Prometheus registry, plus a few database rows."""
from __future__ import annotations

import math
import os
import time

from django.apps import apps
from django.contrib.admin.views.decorators import staff_member_required
from django.http import JsonResponse
from django.shortcuts import render
from prometheus_client import REGISTRY

# Metric families the page reads (names as registered; samples carry _info, _bucket, ... suffixes).
FAMILIES = (
    "pir_batching_policy", "pir_arrival_rate_per_second", "pir_queue_depth", "gpu_batch_size_queries",
    "pir_query_duration_seconds", "pir_query_count", "pir_latency_p95_last_minute_seconds",
    "pir_device_memory_bytes", "pir_epoch", "pir_row_updates_pending", "gpu_queries_answered",
)
RECENT_UPDATES = 10
BULK_JOBS_SHOWN = 20


def _number(value):
    # JSON has no inf/nan: an infinite bucket bound is written "+Inf", as in /metrics.
    if isinstance(value, float) and math.isinf(value):
        return "+Inf"
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _samples(registry):
    wanted = set(FAMILIES)
    for family in registry.collect():
        if family.name in wanted:
            for sample in family.samples:
                yield family.name, sample


def _buckets(samples):
    """Cumulative (le, count) pairs summed over label sets, in bound order."""
    totals = {}
    for sample in samples:
        le = sample.labels["le"]
        totals[le] = totals.get(le, 0) + sample.value
    ordered = sorted(totals.items(), key=lambda item: math.inf if item[0] == "+Inf" else float(item[0]))
    return [[le, count] for le, count in ordered]


def metric_figures(registry=REGISTRY) -> dict:
    """What the page plots, read from the registry `/metrics` exports; None where absent."""
    by_family = {}
    for name, sample in _samples(registry):
        by_family.setdefault(name, []).append(sample)

    def per_lane(family, suffix=""):
        samples = [s for s in by_family.get(family, []) if s.name == family + suffix]
        return {s.labels.get("lane", ""): _number(s.value) for s in samples} if samples else None

    policies = {s.labels["lane"]: {k: v for k, v in s.labels.items() if k != "lane"}
                for s in by_family.get("pir_batching_policy", []) if s.name.endswith("_info")}
    epoch = next((dict(s.labels) for s in by_family.get("pir_epoch", []) if s.name.endswith("_info")), None)
    pending = next((s.value for s in by_family.get("pir_row_updates_pending", [])), None)
    memory = {s.labels["kind"]: s.value for s in by_family.get("pir_device_memory_bytes", [])} or None
    latency = [s for s in by_family.get("pir_query_duration_seconds", []) if s.name.endswith("_bucket")]
    sizes = [s for s in by_family.get("gpu_batch_size_queries", []) if s.name.endswith("_bucket")]
    queries = [s.value for s in by_family.get("pir_query_count", []) if s.name.endswith("_total")]
    return {
        "policies": policies or None,
        "arrival_rate": per_lane("pir_arrival_rate_per_second"),
        "queue_depth": per_lane("pir_queue_depth"),
        "engine_p95_s": per_lane("pir_latency_p95_last_minute_seconds"),
        "answered": per_lane("gpu_queries_answered", "_total"),
        "http_queries": sum(queries) if queries else None,
        "latency_buckets": _buckets(latency) if latency else None,
        "batch_size_buckets": _buckets(sizes) if sizes else None,
        "memory": memory,
        "epoch": epoch,
        "pending_updates": pending,
    }


def database_figures() -> dict:
    """The active epoch record, the latest pending row updates, and bulk jobs still running."""
    from epochs.models import Epoch, RowUpdate, UpdateState

    record = Epoch.objects.active()
    updates = RowUpdate.objects.filter(state=UpdateState.PENDING).order_by("-pk")[:RECENT_UPDATES]
    data = {
        "active_record": None if record is None else {
            "epoch_id": record.epoch_id, "block_number": record.block_number,
            "matrix_path": record.matrix_path, "activated": record.activated.isoformat() if record.activated else None,
            "message": record.message,
        },
        "recent_updates": [{"id": u.pk, "epoch_id": u.epoch_id, "row": u.row,
                            "created": u.created.isoformat()} for u in updates],
        "bulk_jobs": None,
    }
    try:
        job_model = apps.get_model("queries", "BulkJob")
    except LookupError:
        return data  # bulk jobs are not installed in this deployment
    running = job_model.objects.filter(status__in=("queued", "running")).order_by("created")
    data["bulk_jobs"] = [{"id": str(job.pk), "status": job.status, "answered": job.answered,
                          "total": job.total} for job in running[:BULK_JOBS_SHOWN]]
    return data


def snapshot() -> dict:
    return {"time": time.time(), "pid": os.getpid(), **metric_figures(), **database_figures()}


@staff_member_required
def dashboard(request):
    """The page; it draws the first snapshot at once and then polls `dashboard_data`."""
    return render(request, "dashboard.html", {"snapshot": snapshot(), "title": "Operator dashboard"})


@staff_member_required
def dashboard_data(request):
    return JsonResponse(snapshot())
