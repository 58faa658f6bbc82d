"""Admin of epoch records (load, activate) and row updates (push, review); staff only."""
from __future__ import annotations

from django.contrib import admin, messages
from django.utils.html import format_html

from epochs import sync
from epochs.models import Epoch, EpochState, RecordChange, RowUpdate
from gpu_engine.engine import SwitchMode


@admin.register(Epoch)
class EpochAdmin(admin.ModelAdmin):
    list_display = ("epoch_id", "block_number", "state", "num_pages", "switch_mode",
                    "placed", "pending_updates", "activated", "short_message")
    list_filter = ("state",)
    readonly_fields = ("state", "num_pages", "size_bytes", "sha256", "message", "created",
                       "activated", "created_by")
    actions = ["activate_beside", "activate_stop_the_world"]

    @admin.display(description="placement", ordering="placement")
    def placed(self, obj):
        return obj.placement  # the word alone: the choice's explanation is the form's

    @admin.display(description="last switch problem")
    def short_message(self, obj):
        return obj.message[:120]

    def get_readonly_fields(self, request, obj=None):
        # A record that served answers is history: only how to switch back to it may change.
        if obj is not None and obj.state != EpochState.LOADED:
            return [f.name for f in Epoch._meta.fields
                    if f.name not in ("switch_mode", "pending_updates", "placement")]
        return self.readonly_fields

    def save_model(self, request, obj, form, change):
        if not change:
            obj.created_by = request.user
        super().save_model(request, obj, form, change)

    def has_delete_permission(self, request, obj=None):
        return obj is None or obj.state == EpochState.LOADED

    def _activate(self, request, queryset, mode: SwitchMode):
        if queryset.count() != 1:
            self.message_user(request, "select exactly one epoch to activate", messages.ERROR)
            return
        record = queryset.get()
        try:
            sync.activate(record, mode)
        except sync.EpochSwitchError as exc:
            self.message_user(request, f"epoch {record.epoch_id} was not activated: {exc}", messages.ERROR)
            return
        self.message_user(request, f"epoch {record.epoch_id} is active; every engine of this party "
                                   f"serves it within a second", messages.SUCCESS)

    @admin.action(description="Activate (prepare beside the current epoch)", permissions=["change"])
    def activate_beside(self, request, queryset):
        self._activate(request, queryset, SwitchMode.BESIDE)

    @admin.action(description="Activate with stop-the-world (frees the current epoch first)",
                  permissions=["change"])
    def activate_stop_the_world(self, request, queryset):
        self._activate(request, queryset, SwitchMode.STOP_THE_WORLD)


@admin.register(RowUpdate)
class RowUpdateAdmin(admin.ModelAdmin):
    list_display = ("id", "epoch_id", "row", "state", "data_prefix", "created", "created_by")
    list_filter = ("state", "epoch_id")
    search_fields = ("=row",)
    fields = ("row", "data", "epoch_id", "first_epoch_id", "state", "created", "created_by")
    readonly_fields = ("epoch_id", "first_epoch_id", "state", "created", "created_by")

    @admin.display(description="data")
    def data_prefix(self, obj):
        return format_html("<code>{}…</code>", obj.data[:18])

    def save_model(self, request, obj, form, change):
        # Acknowledged (the page reloads) only once this process's engine applied it.
        obj.created_by = request.user
        sync.save_updates([obj])

    def has_change_permission(self, request, obj=None):
        return obj is None  # an update is a durable record: push a new one instead of editing

    def has_delete_permission(self, request, obj=None):
        return False

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("created_by")



@admin.register(RecordChange)
class RecordChangeAdmin(admin.ModelAdmin):
    """Review only: a change is made through /api/records/, which refuses one with no room (409)
    before anything is stored."""

    list_display = ("id", "epoch_id", "op", "key", "record_type", "rows", "created", "created_by")
    list_filter = ("op", "epoch_id")
    search_fields = ("key",)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
