"""Admin for bulk jobs: progress at a glance, chunks per job, and a cancel action."""

from __future__ import annotations

from django.contrib import admin, messages
from django.template.defaultfilters import pluralize
from django.utils.html import format_html

from queries import bulk
from queries.models import BulkChunk, BulkJob


class BulkChunkInline(admin.TabularInline):
    """A job's chunks: who holds each, how often it was tried, last error."""

    model = BulkChunk
    fields = [
        "index",
        "first",
        "count",
        "answered",
        "status",
        "attempts",
        "worker",
        "lease_expires",
        "dispatched",
        "error",
    ]
    readonly_fields = fields
    extra = 0
    max_num = 0
    can_delete = False
    show_change_link = False


@admin.register(BulkJob)
class BulkJobAdmin(admin.ModelAdmin):
    """Jobs are made through the API; operators watch and cancel them here."""

    list_display = [
        "id",
        "owner",
        "status",
        "progress_bar",
        "total",
        "chunk_size",
        "created",
        "finished",
        "expires",
    ]
    list_filter = ["status"]
    search_fields = ["id", "owner__username"]
    date_hierarchy = "created"
    ordering = ["-created"]
    readonly_fields = [
        "id",
        "owner",
        "status",
        "progress_bar",
        "total",
        "answered",
        "domain_bits",
        "chunk_size",
        "epochs",
        "error",
        "created",
        "started",
        "finished",
        "expires",
    ]
    fields = readonly_fields
    inlines = [BulkChunkInline]
    actions = ["cancel_jobs"]

    def has_add_permission(self, request) -> bool:
        return False

    @admin.display(description="progress")
    def progress_bar(self, job: BulkJob) -> str:
        answered = job.answered_so_far()  # launch by launch, running chunks included
        return format_html(
            '<progress value="{}" max="{}"></progress> {} / {} ({}%)',
            answered,
            job.total,
            answered,
            job.total,
            round(100 * answered / max(1, job.total), 1),
        )

    @admin.display(description="epochs answered against")
    def epochs(self, job: BulkJob) -> str:
        return ", ".join(str(e) for e in job.epoch_ids()) or "-"

    @admin.action(
        description="Cancel selected jobs (running chunks finish, no new ones start)",
        permissions=["change"],
    )
    def cancel_jobs(self, request, queryset) -> None:
        cancelled, finished = 0, []
        for job in queryset:
            try:
                bulk.cancel_job(job)
                cancelled += 1
            except bulk.JobFinished as exc:
                finished.append(f"{exc.job.pk} ({exc.job.status})")
        if cancelled:
            self.message_user(
                request, f"Cancelled {cancelled} job{pluralize(cancelled)}.", messages.SUCCESS
            )
        if finished:
            self.message_user(
                request,
                f"Already finished, left as they are: {', '.join(finished)}",
                messages.WARNING,
            )
