"""Admin for batching policies: active one per lane marked, an activate action, history, live figures."""
from __future__ import annotations

import math

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.shortcuts import redirect
from django.urls import reverse
from django.utils.html import format_html

from engine.holder import peek_engine
from policies.models import BatchingPolicy


def live_figures(lane: str) -> dict | None:
    """The engine's last-minute figures of `lane` in this process, or None without an engine."""
    engine = peek_engine()
    if engine is None:
        return None
    data = engine.snapshot()["lanes"].get(lane, {})
    return {
        "arrival_rate": data.get("arrival_rate", 0.0),
        "mean_batch": data.get("mean_batch_last_minute", math.nan),
        "p95_ms": data.get("p95_last_minute_s", math.nan) * 1000,
        "queued": data.get("queued", 0),
        "policy": data.get("policy", ""),
    }


def _fmt(value: float, unit: str) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.1f} {unit}"


@admin.register(BatchingPolicy)
class BatchingPolicyAdmin(admin.ModelAdmin):
    list_display = ("name", "lane", "is_active", "mode", "max_batch", "window_us", "p95_target_ms",
                    "max_queue", "updated_at", "live")
    list_filter = ("lane", "mode", "active")
    search_fields = ("name", "notes")
    actions = ["activate"]
    readonly_fields = ("active", "live_figures", "created_at", "updated_at")
    fieldsets = (
        (None, {"fields": ("name", "lane", "mode", "active", "live_figures", "notes")}),
        ("Batching", {"fields": ("max_batch", "window_us", "adaptive_threshold")}),
        ("Dispatch", {"fields": ("micro_batch", "streams", "cuda_graph")}),
        ("Latency target (slo)", {"fields": ("p95_target_ms", "safety_margin")}),
        ("Backpressure", {"fields": ("max_queue", "queue_timeout_ms", "max_starvation_ms",
                                     "yield_ms")}),
        ("Record", {"fields": ("created_at", "updated_at")}),
    )

    @admin.display(boolean=True, description="active", ordering="active")
    def is_active(self, obj: BatchingPolicy) -> bool:
        return obj.active

    @admin.display(description="live (last minute)")
    def live(self, obj: BatchingPolicy) -> str:
        if not obj.active:
            return ""
        figures = live_figures(obj.lane)
        if figures is None:
            return "no engine in this process"
        return (f"{_fmt(figures['arrival_rate'], 'q/s')}, batch {_fmt(figures['mean_batch'], '')}, "
                f"p95 {_fmt(figures['p95_ms'], 'ms')}")

    @admin.display(description="live figures of the engine")
    def live_figures(self, obj: BatchingPolicy) -> str:
        if obj.pk is None or not obj.active:
            return "shown for the active policy of a lane"
        figures = live_figures(obj.lane)
        if figures is None:
            return "this process has not started an engine yet"
        return format_html(
            "arrival rate {} · mean batch size {} · p95 latency {} · queued {} · engine applies {}",
            _fmt(figures["arrival_rate"], "queries/s"), _fmt(figures["mean_batch"], "queries"),
            _fmt(figures["p95_ms"], "ms"), figures["queued"], figures["policy"] or "–")

    @admin.action(description="Activate the selected policy (one per lane)")
    def activate(self, request, queryset) -> None:
        chosen = list(queryset)
        lanes = [policy.lane for policy in chosen]
        doubled = sorted({lane for lane in lanes if lanes.count(lane) > 1})
        if doubled:
            self.message_user(request, f"Select at most one policy per lane; got several for "
                                       f"{', '.join(doubled)}. Nothing was activated.", messages.ERROR)
            return
        for policy in chosen:
            if policy.active:
                continue
            unfit = policy.fit_errors()
            if unfit:  # a record written around the model's check
                self.message_user(request, f"Policy {policy.name} was not activated: "
                                           f"{' '.join(unfit.values())}", messages.ERROR)
                continue
            policy.activate()
            # The admin's history (LogEntry): who activated what, when.
            self.log_change(request, policy, f"Activated as the {policy.lane} policy.")
            self.message_user(request, f"Policy {policy.name} is now the {policy.lane} policy; every "
                                       f"engine applies it within a second.", messages.SUCCESS)

    def delete_view(self, request, object_id, extra_context=None):
        # The delete page of the active policy, reached by its URL (the change form shows no
        # delete link for it): the admin's message and the change form, not a bare 403.
        policy = self.get_object(request, unquote(object_id))
        refusal = policy.delete_refusal() if policy is not None else None
        if refusal and super().has_delete_permission(request, policy):
            self.message_user(request, f"Not deleted: {refusal}.", messages.ERROR)
            return redirect(reverse("admin:policies_batchingpolicy_change", args=[policy.pk]))
        return super().delete_view(request, object_id, extra_context)

    def has_delete_permission(self, request, obj=None) -> bool:
        # The active record of a lane stays; activate another one first.
        if obj is not None and obj.active:
            return False
        return super().has_delete_permission(request, obj)

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # it would bypass the active-record guard
        return actions
