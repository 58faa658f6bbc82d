"""Prometheus figures of epochs and the device (served epoch, pending row updates, device memory),
and the operator dashboard's epoch rows (the active record, the latest pending row updates)."""
from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

from engine.holder import peek_engine
from engine.metrics import register_once
from epochs.models import Epoch, RowUpdate, UpdateState
from gpu_engine.engine import EngineBusy

log = logging.getLogger(__name__)

RECENT_UPDATES = 10


class EpochCollector:
    """Read at scrape time from this process's engine and the database; builds no engine."""

    def collect(self) -> Iterable:
        engine = peek_engine()
        if engine is None:
            return
        try:
            epoch = engine.epoch
        except EngineBusy:  # the engine server is away; /health says why
            return
        info = InfoMetricFamily("pir_epoch", "The epoch this process's engine serves.")
        info.add_metric([], {"epoch_id": str(epoch.epoch_id), "block_number": str(epoch.block_number),
                             "num_pages": str(epoch.matrix.num_pages),
                             "domain_bits": str(epoch.matrix.domain_bits)})
        yield info
        try:
            pending = RowUpdate.objects.filter(epoch_id=epoch.epoch_id, state=UpdateState.PENDING).count()
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail because the DB is away
            log.debug("pending row updates not counted: %s", exc)
        else:
            gauge = GaugeMetricFamily("pir_row_updates_pending", "Row updates in force on the served "
                                      "epoch (written over its matrix file).")
            gauge.add_metric([], pending)
            yield gauge
        health = engine.health()
        memory = GaugeMetricFamily("pir_device_memory_bytes", "Device memory: used and total on the "
                                   "device, and resident (this engine's matrix).", labels=["kind"])
        memory.add_metric(["resident"], health.get("resident_bytes") or 0)
        for kind in ("used", "total"):
            if health.get(f"{kind}_bytes") is not None:
                memory.add_metric([kind], health[f"{kind}_bytes"])
        yield memory


def register_collector() -> None:
    """Export the epoch figures from this process's registry (once)."""
    register_once("epochs", EpochCollector)


def served_state() -> dict | None:
    """The state this process's engine answers from (epoch, row updates, digest: what every
    answer's `state` carries, and what differs where the parties diverge), or None."""
    engine = peek_engine()
    if engine is None:
        return None
    try:
        return engine.state.describe()
    except EngineBusy:  # the engine server is away; /health says why
        return None


def dashboard_figures() -> dict:
    """The dashboard's active epoch record, latest pending row updates and served state."""
    record = Epoch.objects.active()
    updates = RowUpdate.objects.filter(state=UpdateState.PENDING).order_by("-pk")[:RECENT_UPDATES]
    return {
        "active_record": None if record is None else {
            "epoch_id": record.epoch_id, "block_number": record.block_number,
            "matrix_path": record.matrix_path, "activated": record.activated.isoformat() if record.activated else None,
            "message": record.message,
        },
        "recent_updates": [{"id": u.pk, "epoch_id": u.epoch_id, "row": u.row,
                            "created": u.created.isoformat()} for u in updates],
        "served_state": served_state(),
    }
